"""The alerts API: rules, incidents, acknowledgements and the webhooks they are delivered to."""

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Response, status

from ..alerts import AlertService
from ..auth import Scope
from ..deps import (
    AlertsDep,
    Limit,
    Offset,
    PrincipalDep,
    QueryRowId,
    RowId,
    RunNamesDep,
    StoreDep,
    authorize_project,
    authorize_run,
)
from ..errors import InvalidRequest, NotFound
from ..schemas import (
    AlertList,
    AlertOut,
    AlertRuleIn,
    AlertRuleList,
    AlertRuleOut,
    AlertRulePatch,
    DeliveryList,
    DeliveryOut,
    IncidentList,
    IncidentOut,
    RuleTypeList,
    RunHealth,
    WebhookIn,
    WebhookList,
    WebhookOut,
)

router = APIRouter(prefix="/api/v1", tags=["alerts"])


@router.get("/alert-rules/types")
def rule_types(alerts: AlertsDep, _principal: PrincipalDep) -> RuleTypeList:
    """The rule types, their parameters with defaults and bounds, and which are on for new projects."""
    return RuleTypeList.model_validate({"data": alerts.rule_types()})


@router.get("/alert-rules")
def list_rules(
    alerts: AlertsDep,
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    project: str | None = None,
    run_id: str | None = None,
) -> AlertRuleList:
    """Rules of a project (its defaults are installed when a project is first seen), or those that
    apply to one run (project-wide ones and the run's own)."""
    if run_id is not None:
        run_id = authorize_run(store, principal, run_id, "read")
    rules = names.in_documents(
        alerts.list_rules(principal.only_project(project) if run_id is None else project, run_id)
    )
    return AlertRuleList(data=[AlertRuleOut(**r) for r in rules], count=len(rules))


@router.post("/alert-rules", status_code=status.HTTP_201_CREATED)
def create_rule(
    rule: AlertRuleIn, alerts: AlertsDep, store: StoreDep, principal: PrincipalDep, names: RunNamesDep
) -> AlertRuleOut:
    """Create a rule for a project, or for one run of it (run_id)."""
    principal.require(rule.project, "admin", f"project {rule.project!r}")
    if rule.run_id is not None:  # the run as the caller names it (deps.authorize_run)
        try:
            stored, project = store.find_run(rule.run_id, principal.home_project)
        except NotFound:
            stored, project = "", None
        if project != rule.project:
            # One answer for every absent run: another project's run ids are not for this caller to learn.
            raise InvalidRequest(f"run_id {rule.run_id!r}: no such run in project {rule.project!r}")
        rule = rule.model_copy(update={"run_id": stored})
    return AlertRuleOut(**names.in_documents([alerts.create_rule(rule)])[0])


def _rule(alerts: AlertService, principal: PrincipalDep, rule_id: RowId, scope: Scope) -> dict[str, Any]:
    rule = alerts.get_rule(rule_id)
    authorize_project(principal, rule["project"], scope, f"alert rule {rule_id}")
    return rule


@router.get("/alert-rules/{rule_id}")
def get_rule(rule_id: RowId, alerts: AlertsDep, principal: PrincipalDep, names: RunNamesDep) -> AlertRuleOut:
    return AlertRuleOut(**names.in_documents([_rule(alerts, principal, rule_id, "read")])[0])


@router.patch("/alert-rules/{rule_id}")
def update_rule(
    rule_id: RowId, patch: AlertRulePatch, alerts: AlertsDep, principal: PrincipalDep, names: RunNamesDep
) -> AlertRuleOut:
    """Edit a rule; new params (or disabling it) restart its evaluation and resolve its open alerts."""
    _rule(alerts, principal, rule_id, "admin")
    return AlertRuleOut(**names.in_documents([alerts.update_rule(rule_id, patch)])[0])


@router.delete("/alert-rules/{rule_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_rule(rule_id: RowId, alerts: AlertsDep, principal: PrincipalDep) -> Response:
    _rule(alerts, principal, rule_id, "admin")
    alerts.delete_rule(rule_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/alerts")
def list_alerts(
    alerts: AlertsDep,
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    project: str | None = None,
    run_id: str | None = None,
    status: Literal["firing", "resolved"] | None = None,
    acknowledged: bool | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> AlertList:
    """Alerts, newest first, with evidence, hint and a link to the run page at the alert's step."""
    if run_id is not None:
        run_id = authorize_run(store, principal, run_id, "read")
    else:
        project = principal.only_project(project)
    records, total = alerts.list_alerts(project, run_id, status, limit, offset, acknowledged)
    return AlertList(data=[AlertOut(**a) for a in names.in_documents(records)], count=total)


@router.get("/alerts/{alert_id}")
def get_alert(alert_id: RowId, alerts: AlertsDep, principal: PrincipalDep, names: RunNamesDep) -> AlertOut:
    alert = alerts.get_alert(alert_id)
    authorize_project(principal, alert["project"], "read", f"alert {alert_id}")
    return AlertOut(**names.in_documents([alert])[0])


@router.post("/alerts/{alert_id}/acknowledge")
def acknowledge_alert(
    alert_id: RowId, alerts: AlertsDep, principal: PrincipalDep, names: RunNamesDep
) -> AlertOut:
    """Mark an alert as seen; it stays firing until its condition clears."""
    authorize_project(principal, alerts.get_alert(alert_id)["project"], "admin", f"alert {alert_id}")
    return AlertOut(**names.in_documents([alerts.acknowledge(alert_id)])[0])


@router.get("/incidents")
def list_incidents(
    alerts: AlertsDep,
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    project: str | None = None,
    run_id: str | None = None,
    status: Literal["open", "resolved"] | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> IncidentList:
    """Incidents (alerts of one cause grouped, notified once), newest first, with cause and next steps."""
    if run_id is not None:
        run_id = authorize_run(store, principal, run_id, "read")
    else:
        project = principal.only_project(project)
    records, total = alerts.list_incidents(project, run_id, status, limit, offset)
    return IncidentList(data=[IncidentOut(**i) for i in names.in_documents(records)], count=total)


@router.get("/incidents/{incident_id}")
def get_incident(
    incident_id: RowId, alerts: AlertsDep, principal: PrincipalDep, names: RunNamesDep
) -> IncidentOut:
    incident = alerts.get_incident(incident_id)
    authorize_project(principal, incident["project"], "read", f"incident {incident_id}")
    return IncidentOut(**names.in_documents([incident])[0])


@router.get("/runs/{run_id}/incidents")
def run_incidents(
    run_id: str,
    alerts: AlertsDep,
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    limit: Limit = 100,
) -> RunHealth:
    """A run's verdict (healthy / warning / critical: the worst open incident) and its incidents."""
    run_id = authorize_run(store, principal, run_id, "read")
    records, total, verdict = alerts.run_health(run_id, limit)
    return RunHealth(
        verdict=verdict, data=[IncidentOut(**i) for i in names.in_documents(records)], count=total
    )


def _webhook(
    alerts: AlertService, principal: PrincipalDep, webhook_id: RowId, scope: Scope
) -> dict[str, Any]:
    hook = alerts.get_webhook(webhook_id)
    authorize_project(principal, hook["project"], scope, f"webhook {webhook_id}")
    return hook


@router.post("/webhooks", status_code=status.HTTP_201_CREATED)
def create_webhook(webhook: WebhookIn, alerts: AlertsDep, principal: PrincipalDep) -> WebhookOut:
    """Subscribe a URL to a project's alerts (format json, slack or discord; optional HMAC secret)."""
    principal.require(webhook.project, "admin", f"project {webhook.project!r}")
    return WebhookOut(**alerts.create_webhook(webhook))


@router.get("/webhooks")
def list_webhooks(alerts: AlertsDep, principal: PrincipalDep, project: str | None = None) -> WebhookList:
    """A project's webhooks; read tokens see each URL's scheme and host only (Slack and Discord webhook
    URLs are credentials)."""
    hooks = [_shown(w, principal) for w in alerts.list_webhooks(principal.only_project(project))]
    return WebhookList(data=[WebhookOut(**w) for w in hooks], count=len(hooks))


@router.get("/webhooks/{webhook_id}")
def get_webhook(webhook_id: RowId, alerts: AlertsDep, principal: PrincipalDep) -> WebhookOut:
    return WebhookOut(**_shown(_webhook(alerts, principal, webhook_id, "read"), principal))


# A refused redirect's Location in a delivery's error: for admins only (it can name internal hosts).
_REDIRECT_TARGET = re.compile(r"redirect to (?:'[^']*'|\"[^\"]*\") not followed")


def _deliveries(records: list[dict[str, Any]], principal: PrincipalDep) -> list[DeliveryOut]:
    admin = principal.open or "admin" in principal.scopes
    shown = []
    for record in records:
        error = record.get("last_error")
        if not admin and error:
            record = record | {"last_error": _REDIRECT_TARGET.sub("redirect not followed", error)}
        shown.append(DeliveryOut(**record))
    return shown


def _shown(hook: dict[str, Any], principal: PrincipalDep) -> dict[str, Any]:
    if principal.allows(hook["project"], "admin"):
        return hook
    parts = urlsplit(hook["url"])
    return hook | {"url": f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/…"}


@router.delete("/webhooks/{webhook_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_webhook(webhook_id: RowId, alerts: AlertsDep, principal: PrincipalDep) -> Response:
    _webhook(alerts, principal, webhook_id, "admin")
    alerts.delete_webhook(webhook_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/webhooks/{webhook_id}/test", status_code=status.HTTP_202_ACCEPTED)
def send_test(webhook_id: RowId, alerts: AlertsDep, principal: PrincipalDep) -> DeliveryOut:
    """Queue a test notification; follow it in GET /api/v1/webhooks/{id}/deliveries."""
    _webhook(alerts, principal, webhook_id, "admin")
    return DeliveryOut(**alerts.send_test(webhook_id))


@router.get("/webhooks/{webhook_id}/deliveries")
def webhook_deliveries(
    webhook_id: RowId, alerts: AlertsDep, principal: PrincipalDep, limit: Limit = 100, offset: Offset = 0
) -> DeliveryList:
    """One webhook's delivery log, newest first."""
    _webhook(alerts, principal, webhook_id, "read")
    records, total = alerts.list_deliveries(webhook_id, None, None, limit, offset)
    return DeliveryList(data=_deliveries(records, principal), count=total)


@router.get("/deliveries")
def list_deliveries(
    alerts: AlertsDep,
    principal: PrincipalDep,
    webhook_id: QueryRowId = None,
    alert_id: QueryRowId = None,
    status: Literal["pending", "sending", "delivered", "failed"] | None = None,
    project: str | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> DeliveryList:
    """The delivery log across webhooks, newest first."""
    records, total = alerts.list_deliveries(
        webhook_id, alert_id, status, limit, offset, project=principal.only_project(project)
    )
    return DeliveryList(data=_deliveries(records, principal), count=total)
