"""Request and response bodies of the JSON API (pydantic), apart from the ORM tables.

Non-finite floats: requests may carry JSON's NaN/Infinity literals or the strings "NaN", "Infinity",
"-Infinity"; responses always use the strings, so any JSON parser reads them.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

MAX_DOCUMENT_DEPTH = 32


def _plain_text(value: str) -> str:
    """Names and keys are stored as text: no NUL characters (PostgreSQL refuses them) and no lone
    UTF-16 surrogates (not encodable as UTF-8)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return _unicode(value)


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"is not valid Unicode text (a lone surrogate at position {exc.start} of {value[:40]!r})"
        ) from None
    return value


def _shallow(document: dict[str, Any]) -> dict[str, Any]:
    """A free-form JSON document nested at most MAX_DOCUMENT_DEPTH levels, with plain-text keys and
    string values that are valid Unicode (a lone surrogate stored once would fail every answer
    that carries it: a run's config in the project's run list, an event's data in the run's events)."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DOCUMENT_DEPTH:
            raise ValueError(f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels")
        if isinstance(node, str):
            _unicode(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                _plain_text(str(key))
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
    return document


Document = Annotated[dict[str, Any], AfterValidator(_shallow)]


def _unpacked(code: Any, name: str, dtype: str) -> np.ndarray:
    """The numbers of a packed series field (base64 of 8-byte little-endian numbers)."""
    if not isinstance(code, str) or len(code) > (MAX_POINTS_PER_SERIES * 8 + 2) // 3 * 4:
        raise ValueError(f"{name} must be a base64 string of at most MAX_POINTS_PER_SERIES numbers")
    try:
        raw = base64.b64decode(code, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{name} is not valid base64: {exc}") from None
    if len(raw) % 8:
        unit = "float64s" if dtype.endswith("f8") else "int64s"
        raise ValueError(f"{name} holds {len(raw)} bytes, not a whole number of {unit}")
    return np.frombuffer(raw, dtype=dtype)


def _no_booleans(values: Any) -> Any:
    """JSON true/false would pass as 1.0/0.0; a metric that is a boolean is a client bug."""
    if isinstance(values, list) and bool in set(map(type, values)):  # at C speed: batches are large
        raise ValueError('values must be numbers (or "NaN", "Infinity", "-Infinity"), not true/false')
    return values


Text = AfterValidator(_plain_text)

RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Client- or server-chosen id")]
Name = Annotated[str, Field(min_length=1, max_length=200), Text]
MetricKey = Annotated[str, Field(min_length=1, max_length=250), Text]
MAX_STEP = 2**62
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
RunStatus = Literal["running", "finished", "crashed"]
ResumeMode = Literal["allow", "must", "never"]
Tag = Annotated[
    str, Field(min_length=1, max_length=100, description='a label such as "baseline" or "lora-r16"'), Text
]
MAX_TAGS = 50
JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"]

# Per batch: an agent flushes about once a second, so these are generous.
MAX_SERIES_PER_BATCH = 10_000
MAX_POINTS_PER_SERIES = 1_000_000
MAX_EVENTS_PER_BATCH = 100_000


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: RunId | None = None
    project: Name
    name: Name | None = None
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS)
    config: Document = Field(default_factory=dict)
    metadata: Document = Field(default_factory=dict)
    resume: ResumeMode | None = Field(
        default=None,
        description=(
            'continue an existing run (gradwatch.init(resume=...)): "allow" creates the run when there is '
            'none, "must" answers 404 then, "never" answers 409 when the id exists; "allow" and "must" set '
            "an existing run running again. Left out: create, or return the existing run unchanged"
        ),
    )


class RunPatch(BaseModel):
    """Rename a run or replace its tags; fields left out are unchanged."""

    model_config = ConfigDict(extra="forbid")

    name: Name | None = None
    tags: list[Tag] | None = Field(default=None, max_length=MAX_TAGS)


class RunSummary(BaseModel):
    skips: int = Field(description="skip events stored for the run")
    scale: float | str | None = Field(description="latest amp/scale of rank 0, if any")


class RunOut(BaseModel):
    id: str
    project: str
    name: str
    status: str
    status_reason: str | None = Field(
        default=None,
        description='why a run is "crashed": "ValueError: …" (the exception that ended it), "SIGTERM", '
        'or "no heartbeat" (no rank reported for the server\'s crashed_after_s; undone by new data)',
    )
    created_at: str
    updated_at: str
    last_step: int | None
    tags: list[str]
    config: dict[str, Any]
    metadata: dict[str, Any]
    summary: RunSummary


# Batch encodings a server reads beyond plain JSON lists, announced in RunCreated.wire_features: an
# agent uses one only when the server it talks to named it.
WIRE_FEATURES = ("values_f64", "steps_i64")


class RunCreated(RunOut):
    resumed: bool | None = Field(
        default=None,
        description="with `resume` in the request: whether an existing run was continued (false: created)",
    )
    previous_status: str | None = Field(
        default=None, description="a continued run's status before this request set it running"
    )
    previous_status_reason: str | None = Field(default=None, description="and its status_reason then")
    wire_features: list[str] = Field(
        default_factory=lambda: list(WIRE_FEATURES),
        description="batch encodings this server reads beyond plain JSON lists (values_f64, steps_i64: "
        "ScalarSeriesIn)",
    )


class RunList(BaseModel):
    data: list[RunOut]
    count: int = Field(description="runs matching the filter, before limit/offset")


class CompareSeries(BaseModel):
    run_id: str
    name: str
    project: str
    steps: list[int]
    values: list[JsonFloat]
    downsampled: bool


class CompareOut(BaseModel):
    key: str
    rank: int
    data: list[CompareSeries] = Field(description="one series per requested run, in the order asked")


class ScalarSeriesIn(BaseModel):
    """One key's points: `steps` and, paired with them, `values` (JSON numbers, or "NaN", "Infinity",
    "-Infinity") or `values_f64` (the same values as base64 of little-endian float64: what the agent
    sends to a server that announces it; a float costs it 11 characters and no decimal conversion);
    likewise `steps_i64` for the steps (base64 of little-endian int64)."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    steps: list[Step] = Field(max_length=MAX_POINTS_PER_SERIES)
    values: list[float] = Field(max_length=MAX_POINTS_PER_SERIES)

    # (steps, values, the same as int64 / float64 arrays or None) when they came packed: storage takes
    # the arrays as they are. Kept with the lists they mirror, so a copy with other lists (model_copy)
    # does not use them.
    _packed: tuple[list[int], list[float], np.ndarray | None, np.ndarray | None] | None = PrivateAttr(
        default=None
    )

    @model_validator(mode="wrap")
    @classmethod
    def _packed_values(cls, data: Any, handler: ModelWrapValidatorHandler[ScalarSeriesIn]) -> ScalarSeriesIn:
        if not isinstance(data, dict) or ("values_f64" not in data and "steps_i64" not in data):
            return handler(data)
        data = dict(data)
        values = steps = None
        if "values_f64" in data:
            if "values" in data:
                raise ValueError("give a series' values as `values` or as `values_f64`, not both")
            values = _unpacked(data.pop("values_f64"), "values_f64", "<f8").astype(np.float64)
            data["values"] = values
        if "steps_i64" in data:
            if "steps" in data:
                raise ValueError("give a series' steps as `steps` or as `steps_i64`, not both")
            steps = _unpacked(data.pop("steps_i64"), "steps_i64", "<i8").astype(np.int64)
            if len(steps) and (int(steps.min()) < 0 or int(steps.max()) > MAX_STEP):
                raise ValueError(f"steps_i64: every step must be between 0 and {MAX_STEP}")
            data["steps"] = steps
        series = handler(data)
        series._packed = (series.steps, series.values, steps, values)
        return series

    @field_validator("steps", mode="wrap")
    @classmethod
    def _steps(cls, steps: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(steps, np.ndarray):  # unpacked from steps_i64 above: int64s, range checked
            return steps.tolist()
        return handler(steps)

    @field_validator("values", mode="wrap")
    @classmethod
    def _numbers(cls, values: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(values, np.ndarray):  # unpacked from values_f64 above: float64s
            return values.tolist()
        return handler(_no_booleans(values))

    def steps_array(self) -> np.ndarray:
        """The steps as int64 (without a copy when they came as steps_i64)."""
        packed = self._packed
        if packed is not None and packed[2] is not None and packed[0] is self.steps:
            return packed[2]
        return np.asarray(self.steps, dtype=np.int64)

    def values_array(self) -> np.ndarray:
        """The values as float64 (without a copy when they came as values_f64)."""
        packed = self._packed
        if packed is not None and packed[3] is not None and packed[1] is self.values:
            return packed[3]
        return np.asarray(self.values, dtype=np.float64)

    @model_validator(mode="after")
    def _same_length(self) -> ScalarSeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"series {self.key!r}: {len(self.steps)} steps but {len(self.values)} values; "
                "they must pair up"
            )
        return self


MAX_LAYERS = 100_000
LayerName = Annotated[str, Field(min_length=1, max_length=500), Text]


class VectorSeriesIn(BaseModel):
    """One per-layer quantity (e.g. "grad/norm") at several steps: a row of one value per layer."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    steps: list[Step] = Field(max_length=100_000)
    values: list[list[float]] = Field(max_length=100_000)

    @field_validator("values", mode="before")
    @classmethod
    def _numbers(cls, rows: Any) -> Any:
        if isinstance(rows, list):
            for row in rows:
                _no_booleans(row)
        return rows

    @model_validator(mode="after")
    def _rows_pair_with_steps(self) -> VectorSeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"vector {self.key!r}: {len(self.steps)} steps but {len(self.values)} rows; they must pair up"
            )
        widths = {len(row) for row in self.values}
        if len(widths) > 1:
            raise ValueError(f"vector {self.key!r}: rows have different lengths {sorted(widths)}")
        if widths and widths.pop() > MAX_LAYERS:
            raise ValueError(f"vector {self.key!r}: more than {MAX_LAYERS} layers")
        return self


class HistogramIn(BaseModel):
    """Per-layer log2 histograms at one step. Each row: counts for exponents exponent_min..exponent_max
    (bin e counts |g| in [2^(e-1), 2^e)), then the count of zeros, then of NaN/±Inf."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    step: Step
    exponent_min: Annotated[int, Field(ge=-2000, le=2000)]
    exponent_max: Annotated[int, Field(ge=-2000, le=2000)]
    counts: list[list[Annotated[int, Field(ge=0, le=2**63 - 1)]]] = Field(max_length=MAX_LAYERS)

    @model_validator(mode="after")
    def _row_width(self) -> HistogramIn:
        if self.exponent_max < self.exponent_min:
            raise ValueError(
                f"histogram {self.key!r}: exponent_max {self.exponent_max} < exponent_min {self.exponent_min}"
            )
        width = self.exponent_max - self.exponent_min + 3
        for index, row in enumerate(self.counts):
            if len(row) != width:
                raise ValueError(
                    f"histogram {self.key!r}: row {index} has {len(row)} counts, expected {width} "
                    "(one per exponent, then zeros, then non-finite)"
                )
        return self


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: Step
    kind: Annotated[str, Field(min_length=1, max_length=64), Text]
    data: Document = Field(default_factory=dict)


class BatchIn(BaseModel):
    """One flush of one agent rank. (run, rank, seq) identifies it: a repeat is acknowledged, not stored."""

    model_config = ConfigDict(extra="forbid")

    rank: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    seq: Annotated[int, Field(ge=0, le=2**63 - 1)]
    scalars: list[ScalarSeriesIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    events: list[EventIn] = Field(default_factory=list, max_length=MAX_EVENTS_PER_BATCH)
    vectors: list[VectorSeriesIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    histograms: list[HistogramIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    layers: list[LayerName] | None = Field(
        default=None, max_length=MAX_LAYERS, description="names of the vectors' entries, in order"
    )
    status: RunStatus | None = None


class VectorsOut(BaseModel):
    key: str
    rank: int
    layers: list[str]
    steps: list[int] = Field(description="first step of each (possibly downsampled) column")
    values: list[list[JsonFloat]] = Field(description="one row per step, one value per layer")
    downsampled: bool = Field(description="true when steps were merged (max per layer, non-finite kept)")


class HistogramsOut(BaseModel):
    key: str
    rank: int
    layer: str
    exponents: list[int] = Field(description="bin e counts |g| in [2^(e-1), 2^e); ends are open")
    steps: list[int]
    counts: list[list[int]] = Field(description="one row per step, one count per exponent")
    zeros: list[int]
    non_finite: list[int]


class BatchAck(BaseModel):
    duplicate: bool = Field(description="true when this (run, rank, seq) was stored before")
    points: int
    events: int
    superseded_from: int | None = Field(
        None,
        description="present when a later process resumed the rank at this step: the batch's data from "
        "this step on was not stored (it belongs to a process the resume replaced)",
    )


class SeriesOut(BaseModel):
    key: str
    rank: int
    steps: list[int]
    values: list[JsonFloat]
    downsampled: bool = Field(description="true when the range held more than max_points points")


class EventOut(BaseModel):
    step: int
    kind: str
    rank: int
    data: dict[str, Any]


class EventList(BaseModel):
    data: list[EventOut]
    count: int


class KeyList(BaseModel):
    data: list[str]
    kind: str


def json_float(value: float) -> JsonFloat:
    """A float as the API writes it: finite as a number, the rest as "NaN"/"Infinity"/"-Infinity"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


# -- the ranks of a distributed run ---------------------------------------------------------------


class RankOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.RankInfo

    rank: int
    host: str | None
    local_rank: int | None
    world_size: int | None
    pid: int | None
    parallelism: str | None = Field(description="fsdp2, fsdp, ddp, dtensor or none")
    gradients: str | None = Field(description="sharded, replicated, hybrid or local")
    histograms: bool | None = Field(description="whether this rank takes gradient histograms")
    status: str | None = Field(description="how the rank ended (finished, crashed); null while running")
    batches: int
    last_seen: float | None = Field(description="seconds since the epoch of the rank's newest batch")


class RankList(BaseModel):
    data: list[RankOut]
    count: int
    world_size: int
    gradients: str = Field(description="the layout the ranks reported; mixed if they differ")


class CombinedSeriesOut(BaseModel):
    key: str
    combine: str = Field(description="the mode applied (auto resolved)")
    ranks: list[int]
    steps: list[int]
    values: list[JsonFloat]
    per_rank: dict[str, list[JsonFloat]] = Field(description="rank -> its value at each of steps")
    downsampled: bool


class CombinedVectorsOut(BaseModel):
    key: str
    combine: str
    ranks: list[int]
    layers: list[str]
    steps: list[int]
    values: list[list[JsonFloat]]
    downsampled: bool


class CombinedHistogramsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.CombinedHistograms

    key: str
    layer: str
    combine: str
    ranks: list[int]
    exponents: list[int]
    steps: list[int]
    counts: list[list[int]]
    zeros: list[int]
    non_finite: list[int]


class DisagreementOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.Disagreement

    step: int
    skipped_ranks: list[int]
    applied_ranks: list[int]
    layers: list[str]


class DisagreementList(BaseModel):
    data: list[DisagreementOut]
    count: int = Field(description="disagreeing steps in the range, before limit")


# -- alerts, webhooks, deliveries -----------------------------------------------------------------

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
    params: dict[str, Any] | None = Field(
        default=None, description="replaces the parameters (others default)"
    )
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
