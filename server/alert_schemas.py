"""Request and response bodies of the alerting API (pydantic): alert rules and their types, alerts,
incidents and a run's health, webhooks and their deliveries.

They are built from the field types of gradwatch.server.schema_fields, as the rest of the API's
bodies are, and gradwatch.server.schemas re-exports every one of them, so callers import them from
there; gradwatch.server.routers.alerts serves them and gradwatch.server.alerts reads the requests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .schema_fields import Document, Name, RunId

WebhookFormat = Literal["json", "slack", "discord"]


class AlertRuleIn(BaseModel):
    """A rule to create. type: one of GET /api/v1/alert-rules/types; params default per type."""

    model_config = ConfigDict(extra="forbid")

    project: Name
    run_id: RunId | None = Field(default=None, description="limit the rule to one run of the project")
    type: Annotated[str, Field(min_length=1, max_length=64)]
    name: Name | None = None
    params: Document = Field(default_factory=dict)
    enabled: bool = True
    cooldown_steps: Annotated[int, Field(ge=0, le=2**62)] | None = Field(
        default=None,
        description="a re-trigger within this many steps of the alert's step reopens it without a new "
        "notification (default per type: 100, heartbeat 0)",
    )


class AlertRulePatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name | None = None
    params: Document | None = Field(default=None, description="replaces the parameters (others default)")
    enabled: bool | None = None
    cooldown_steps: Annotated[int, Field(ge=0, le=2**62)] | None = None


class AlertRuleOut(BaseModel):
    id: int
    project: str
    run_id: str | None
    type: str
    name: str
    params: dict[str, Any]
    enabled: bool
    cooldown_steps: int
    severity: str
    description: str


class AlertRuleList(BaseModel):
    data: list[AlertRuleOut]
    count: int


class RuleParamOut(BaseModel):
    default: float | int | str
    minimum: float | None
    maximum: float | None
    doc: str


class RuleTypeOut(BaseModel):
    type: str
    severity: str
    description: str
    params: dict[str, RuleParamOut]
    default_rule: bool = Field(description="installed for every new project")


class RuleTypeList(BaseModel):
    data: list[RuleTypeOut]


class AlertOut(BaseModel):
    id: int
    project: str
    run_id: str
    run_name: str
    rule_id: int | None
    type: str
    severity: str
    status: Literal["firing", "resolved"]
    step: int | None = Field(description="the step where the condition first held")
    last_step: int | None
    resolved_step: int | None
    occurrences: int = Field(description="steps the condition held while open (de-duplicated)")
    title: str
    hint: str = Field(description="what probably happened and what to try")
    evidence: dict[str, Any] = Field(description="steps, values, layers… and link")
    link: str = Field(description="the run page at the alert's step")
    created_at: str | None
    resolved_at: str | None
    acknowledged_at: str | None = Field(
        default=None, description="when someone acknowledged it, if anyone did"
    )
    incident_id: int | None = Field(default=None, description="the incident this alert is part of")


class AlertList(BaseModel):
    data: list[AlertOut]
    count: int


class IncidentFinding(BaseModel):
    rule: str
    title: str
    step: int
    last_step: int | None = None
    severity: str
    status: str | None = None
    alert_id: int | None = None
    evidence: dict[str, Any]


class IncidentOut(BaseModel):
    """Findings of one cause in one run, grouped and notified once (see gradwatch.server.alerts.incidents)."""

    id: int
    project: str
    run_id: str
    run_name: str
    status: Literal["open", "resolved"]
    severity: str
    family: str = Field(description="precision | divergence | data | stalled | liveness")
    cause_key: str
    title: str = Field(description="a short headline")
    cause: str = Field(description="the most likely cause, in one sentence")
    next_steps: list[str] = Field(description="what to do, with numbers")
    rules: list[str] = Field(description="the rule types that fired in this incident")
    layers: list[str] = Field(
        default_factory=list, description="the layers the diagnosis names, most likely first"
    )
    findings: list[IncidentFinding]
    first_step: int
    last_step: int
    last_healthy_step: int | None = Field(
        default=None,
        description="rewind to a checkpoint at or before this step: the step before the first evidence "
        "(of an earlier incident of the run that announced this one, where one was still active)",
    )
    resolved_step: int | None
    link: str = Field(description="the run page at the incident's first step")
    created_at: str | None
    updated_at: str | None
    resolved_at: str | None
    notified_at: str | None = Field(
        description="when its one notification was sent (null: not yet, or never)"
    )


class IncidentList(BaseModel):
    data: list[IncidentOut]
    count: int


class RunHealth(BaseModel):
    """A run's verdict and its incidents, newest first."""

    verdict: Literal["healthy", "warning", "critical"]
    data: list[IncidentOut]
    count: int


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=2000)]
    format: WebhookFormat = "json"
    project: Name
    secret: Annotated[str, Field(min_length=1, max_length=500)] | None = Field(
        default=None, description="signs each request: X-Gradwatch-Signature (HMAC-SHA256)"
    )
    enabled: bool = True
    send_resolved: bool = Field(
        default=False,
        description="also POST when an incident resolves (default: one notification per incident)",
    )


class WebhookOut(BaseModel):
    id: int
    project: str
    url: str
    format: str
    signed: bool = Field(description="true when the webhook has a secret (never returned)")
    enabled: bool
    send_resolved: bool = False
    created_at: str


class WebhookList(BaseModel):
    data: list[WebhookOut]
    count: int


class DeliveryOut(BaseModel):
    id: int
    webhook_id: int
    alert_id: int | None
    event: str
    status: Literal["pending", "sending", "delivered", "failed"]
    attempts: int
    next_attempt_at: str | None
    response_status: int | None
    last_error: str | None
    created_at: str
    delivered_at: str | None


class DeliveryList(BaseModel):
    data: list[DeliveryOut]
    count: int
