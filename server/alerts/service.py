"""Alert rules, alerts, webhooks and deliveries for the API: each method one transaction, plain
dicts out (the routers turn them into schemas), GradwatchServerError subclasses for bad input."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..database import Transactions
from ..errors import InvalidRequest, NotFound
from ..models import Alert, AlertRule, Delivery, Incident, Run, Webhook
from ..schemas import AlertRuleIn, AlertRulePatch, WebhookIn
from ..settings import Settings
from ..storage import alerts as alert_tables
from ..storage.codecs import iso_time
from ..storage.queries import require_run
from .engine import AlertEngine, alert_document
from .incidents import RunVerdict, guard_document, incident_document, verdict, with_rewind_points
from .rules import DEFAULT_RULES, RULE_TYPES, make_rule
from .webhooks import render, validate_url

__all__ = ["AlertService"]


# Alert rules one project may hold (its defaults included, disabled ones too). Every enabled rule is fed
# every batch of the project's runs; with more rules a batch may carry fewer steps
# (engine.MAX_RULE_EVALUATIONS_PER_BATCH), and a project's rules are read on every batch.
MAX_RULES_PER_PROJECT = 100


class AlertService:
    def __init__(self, engine: Engine, alert_engine: AlertEngine, settings: Settings) -> None:
        self.engine = engine
        self.alert_engine = alert_engine
        self.settings = settings
        self._transaction = Transactions(engine)  # commit on success, roll back on any error

    # -- rule types and rules ---------------------------------------------------------------------

    @staticmethod
    def rule_types() -> list[dict[str, Any]]:
        return [
            {
                "type": name,
                "severity": cls.severity,
                "description": cls.description,
                "params": {
                    p: {
                        "default": spec.default,
                        "minimum": spec.minimum,
                        "maximum": spec.maximum,
                        "doc": spec.doc,
                    }
                    for p, spec in cls.params.items()
                },
                "default_rule": name in DEFAULT_RULES,
            }
            for name, cls in RULE_TYPES.items()
        ]

    @staticmethod
    def _rule(row: AlertRule) -> dict[str, Any]:
        cls = RULE_TYPES[row.type]
        return {
            "id": row.id,
            "project": row.project,
            "run_id": row.run_id,
            "type": row.type,
            "name": row.name,
            "params": json.loads(row.params_json),
            "enabled": row.enabled,
            "cooldown_steps": row.cooldown_steps,
            "severity": cls.severity,
            "description": cls.description,
        }

    @staticmethod
    def _validated(rule_type: str, params: dict[str, Any]) -> dict[str, Any]:
        try:
            return make_rule(rule_type, params).values
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(str(exc)) from None

    def list_rules(self, project: str | None, run_id: str | None) -> list[dict[str, Any]]:
        """Rules of a project (its defaults installed on first sight), or those applying to one run."""
        with self._transaction() as session:
            if run_id is not None:
                project = require_run(session, run_id).project
            if project is not None:
                self.alert_engine.ensure_defaults(session, project)
            return [self._rule(row) for row in alert_tables.rules(session, project, run_id)]

    def create_rule(self, rule: AlertRuleIn) -> dict[str, Any]:
        params = self._validated(rule.type, rule.params)
        now = time.time()
        with self._transaction() as session:
            if rule.run_id is not None:
                run = session.get(Run, rule.run_id)
                if run is None or run.project != rule.project:
                    # One answer for both: another project's run ids are not for this caller to learn.
                    raise InvalidRequest(f"run_id {rule.run_id!r}: no such run in project {rule.project!r}")
            self.alert_engine.ensure_defaults(session, rule.project)
            held = alert_tables.count_rules(session, rule.project)
            if held >= MAX_RULES_PER_PROJECT:
                raise InvalidRequest(
                    f"project {rule.project!r} has {held} alert rules, the most a project may hold is"
                    f" {MAX_RULES_PER_PROJECT}: delete one (or change its parameters) before adding another"
                )
            row = AlertRule(
                project=rule.project,
                run_id=rule.run_id,
                type=rule.type,
                name=rule.name or rule.type.replace("_", " "),
                params_json=json.dumps(params),
                enabled=rule.enabled,
                cooldown_steps=RULE_TYPES[rule.type].cooldown_steps
                if rule.cooldown_steps is None
                else rule.cooldown_steps,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            session.flush()
            return self._rule(row)

    def get_rule(self, rule_id: int) -> dict[str, Any]:
        with self._transaction() as session:
            return self._rule(self._require(session, AlertRule, rule_id, "alert rule"))

    def update_rule(self, rule_id: int, patch: AlertRulePatch) -> dict[str, Any]:
        """Edit a rule. New params restart its evaluation: state is dropped and open alerts resolved."""
        with self._transaction() as session:
            row = self._require(session, AlertRule, rule_id, "alert rule")
            if patch.params is not None:
                row.params_json = json.dumps(self._validated(row.type, patch.params))
                self._restart(session, rule_id)
            if patch.enabled is False and row.enabled:
                self._restart(session, rule_id)
            for name in ("name", "enabled", "cooldown_steps"):
                value = getattr(patch, name)
                if value is not None:
                    setattr(row, name, value)
            row.updated_at = time.time()
            return self._rule(row)

    def delete_rule(self, rule_id: int) -> None:
        with self._transaction() as session:
            row = self._require(session, AlertRule, rule_id, "alert rule")
            self._restart(session, rule_id)
            alert_tables.detach_alerts(session, rule_id)
            session.delete(row)

    @staticmethod
    def _restart(session: Session, rule_id: int) -> None:
        alert_tables.restart_rule(session, rule_id, time.time())

    # -- alerts -----------------------------------------------------------------------------------

    def list_alerts(
        self,
        project: str | None,
        run_id: str | None,
        status: str | None,
        limit: int,
        offset: int,
        acknowledged: bool | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Alerts, newest first, and how many match before limit/offset."""
        with self._transaction() as session:
            rows, total = alert_tables.alerts_page(
                session, project, run_id, status, acknowledged, limit, offset
            )
            return [alert_document(alert, name) for alert, name in rows], total

    def get_alert(self, alert_id: int) -> dict[str, Any]:
        with self._transaction() as session:
            alert = self._require(session, Alert, alert_id, "alert")
            run = session.get(Run, alert.run_id)
            return alert_document(alert, run.name if run else alert.run_id)

    def acknowledge(self, alert_id: int) -> dict[str, Any]:
        """Mark an alert as seen (it stays firing until its condition clears); repeating it is harmless."""
        with self._transaction() as session:
            alert = self._require(session, Alert, alert_id, "alert")
            if alert.acknowledged_at is None:
                alert.acknowledged_at = time.time()
            run = session.get(Run, alert.run_id)
            return alert_document(alert, run.name if run else alert.run_id)

    # -- incidents --------------------------------------------------------------------------------

    def list_incidents(
        self, project: str | None, run_id: str | None, status: str | None, limit: int, offset: int
    ) -> tuple[list[dict[str, Any]], int]:
        """Incidents, newest first, and how many match before limit/offset."""
        with self._transaction() as session:
            rows, total = alert_tables.incidents_page(session, project, run_id, status, limit, offset)
            return with_rewind_points([incident_document(incident, name) for incident, name in rows]), total

    def run_health(self, run_id: str, limit: int) -> tuple[list[dict[str, Any]], int, RunVerdict]:
        """A run's incidents (newest first), their count, and its verdict: healthy | warning | critical."""
        with self._transaction() as session:
            run = require_run(session, run_id)
            documents = with_rewind_points(
                [incident_document(i, run.name) for i in alert_tables.run_incidents(session, run_id)]
            )
            return documents[:limit], len(documents), verdict(documents)

    def guard_incidents(self, run_id: str) -> list[dict[str, Any]]:
        """The run's open incidents as its agent's guard reads them (see incidents.guard_document)."""
        with self._transaction() as session:
            return with_rewind_points(
                [guard_document(i) for i in alert_tables.open_incidents(session, run_id)]
            )

    def get_incident(self, incident_id: int) -> dict[str, Any]:
        with self._transaction() as session:
            incident = self._require(session, Incident, incident_id, "incident")
            run = session.get(Run, incident.run_id)
            return incident_document(incident, run.name if run else incident.run_id)

    # -- webhooks and deliveries ------------------------------------------------------------------

    @staticmethod
    def _webhook(row: Webhook) -> dict[str, Any]:
        return {
            "id": row.id,
            "project": row.project,
            "url": row.url,
            "format": row.format,
            "signed": bool(row.secret),
            "enabled": row.enabled,
            "send_resolved": row.send_resolved,
            "created_at": iso_time(row.created_at),
        }

    def _check_url(self, url: str) -> None:
        """InvalidRequest unless the URL may be sent to under these settings (a host name's addresses are
        judged when it is sent: egress.PinnedTransport)."""
        try:
            validate_url(
                url, self.settings.webhook_allowed_hosts, allow_private=self.settings.webhook_allow_private
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def create_webhook(self, webhook: WebhookIn) -> dict[str, Any]:
        self._check_url(webhook.url)
        with self._transaction() as session:
            row = Webhook(
                project=webhook.project,
                url=webhook.url,
                format=webhook.format,
                secret=webhook.secret,
                enabled=webhook.enabled,
                send_resolved=webhook.send_resolved,
                created_at=time.time(),
            )
            session.add(row)
            session.flush()
            return self._webhook(row)

    def list_webhooks(self, project: str | None) -> list[dict[str, Any]]:
        with self._transaction() as session:
            return [self._webhook(row) for row in alert_tables.webhooks(session, project)]

    def get_webhook(self, webhook_id: int) -> dict[str, Any]:
        with self._transaction() as session:
            return self._webhook(self._require(session, Webhook, webhook_id, "webhook"))

    def delete_webhook(self, webhook_id: int) -> None:
        with self._transaction() as session:
            row = self._require(session, Webhook, webhook_id, "webhook")
            alert_tables.delete_deliveries(session, webhook_id)
            session.delete(row)

    def send_test(self, webhook_id: int) -> dict[str, Any]:
        """Enqueue a test notification to one webhook; the delivery log shows how it went."""
        with self._transaction() as session:
            webhook = self._require(session, Webhook, webhook_id, "webhook")
            if not webhook.enabled:
                raise InvalidRequest(f"webhook {webhook_id} is disabled: enable it to send a test")
            self._check_url(webhook.url)  # the settings may have changed since it was created
            now = time.time()
            sample = {
                "id": None,
                "project": webhook.project,
                "run_id": None,
                "run_name": "test",
                "status": "open",
                "severity": "info",
                "family": "test",
                "cause_key": "test",
                "title": "gradwatch test notification",
                "cause": "Nothing to do: this checks that the webhook receives gradwatch incidents.",
                "next_steps": [],
                "rules": [],
                "findings": [],
                "first_step": None,
                "last_step": None,
                "resolved_step": None,
                "link": f"{self.settings.public_url.rstrip('/')}/dashboard/",
                "created_at": iso_time(now),
                "updated_at": iso_time(now),
                "resolved_at": None,
                "notified_at": None,
            }
            delivery = Delivery(
                webhook_id=webhook.id,
                alert_id=None,
                event="test",
                payload=render(webhook.format, "test", sample),
                status="pending",
                attempts=0,
                next_attempt_at=now,
                created_at=now,
            )
            session.add(delivery)
            session.flush()
            self.alert_engine.notify_after_commit(session)
            return self._delivery(delivery)

    @staticmethod
    def _delivery(row: Delivery) -> dict[str, Any]:
        return {
            "id": row.id,
            "webhook_id": row.webhook_id,
            "alert_id": row.alert_id,
            "event": row.event,
            "status": row.status,
            "attempts": row.attempts,
            "next_attempt_at": iso_time(row.next_attempt_at) if row.status == "pending" else None,
            "response_status": row.response_status,
            "last_error": row.last_error,
            "created_at": iso_time(row.created_at),
            "delivered_at": iso_time(row.delivered_at),
        }

    def list_deliveries(
        self,
        webhook_id: int | None,
        alert_id: int | None,
        status: str | None,
        limit: int,
        offset: int,
        project: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """The delivery log, newest first (of one project's webhooks if project is given)."""
        with self._transaction() as session:
            if webhook_id is not None:
                hook = self._require(session, Webhook, webhook_id, "webhook")
                if project is not None and hook.project != project:  # as if absent: no existence oracle
                    raise NotFound(f"webhook {webhook_id} does not exist")
            rows, total = alert_tables.deliveries_page(
                session, project, webhook_id, alert_id, status, limit, offset
            )
            return [self._delivery(row) for row in rows], total

    @staticmethod
    def _require(session: Session, model: Any, key: int, what: str) -> Any:
        row = session.get(model, key)
        if row is None:
            raise NotFound(f"{what} {key} does not exist")
        return row
