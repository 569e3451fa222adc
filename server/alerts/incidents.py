"""Incidents: one cause, one notification (Prometheus Alertmanager's group_by / group_wait, per run).

An alert that opens joins an open incident of its run when it is of the same family (rules.RuleType.
family: precision, divergence, data, stalled, liveness), starts within GROUP_WINDOW_STEPS of the
incident's first step (an lr jump, the loss spike and the skip storm it causes are one incident), or
is a stalled layer while a divergence, overflow or NaN incident is open (the layers it killed);
otherwise it opens a new incident. An incident is notified once, when its group wait ends: the run
reached first_step + group_wait_steps, or group_wait_s passed with no data (a crashed run), or the run
ended. By then the rules that fire together have joined, and diagnosis.diagnose() names the cause.
Later findings update the incident without a new notification unless they change its cause: then the
new cause is sent as an update (incident.updated). It resolves when all its alerts have, and one that
resolves before its notification was due is never sent (a blip, not an incident).

Everything here runs in the caller's transaction (ingest, or the outbox worker's periodic task).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from sqlalchemy.orm import Session

from ..models import Alert, Delivery, Incident, Run
from ..storage import alerts as alert_tables
from ..storage import chunked_points
from ..storage.codecs import dump_json, iso_time, unpack
from ..storage.queries import events_of_kinds
from .diagnosis import SEVERITY_ORDER, RunContext, diagnose, finding_onset
from .rules import MISUSE_EVENTS, RULE_TYPES
from .webhooks import render

__all__ = ["GROUP_WINDOW_STEPS", "Incidents", "RunVerdict", "incident_document", "verdict"]

GROUP_WINDOW_STEPS = 50
MAX_FINDINGS = 30


def _recovered_step(session: Session, run: Run, alerts: Sequence[Alert]) -> int | None:
    """The step by which the run was healthy again after the incident's findings, or None: every alert
    resolved by its own rule; or every one but scale_drop, with no step skipped since the others' last
    finding (after a burst the GradScaler grows its scale back only every growth_interval steps, 2,000
    by default: a lower scale that no longer overflows is no lasting problem)."""
    if all(a.status == "resolved" for a in alerts):
        return max((a.resolved_step for a in alerts if a.resolved_step is not None), default=None)
    others = [a for a in alerts if a.type != "scale_drop"]
    if not others or any(a.status != "resolved" for a in others):
        return None
    burst_end = max(a.last_step or a.step or 0 for a in others)
    if alert_tables.skipped_since(session, run.id, burst_end):
        return None
    return max((a.resolved_step for a in others if a.resolved_step is not None), default=None)


def incident_document(incident: Incident, run_name: str) -> dict[str, Any]:
    """An incident as the API returns it and webhooks carry it."""
    return {
        "id": incident.id,
        "project": incident.project,
        "run_id": incident.run_id,
        "run_name": run_name,
        "status": incident.status,
        "severity": incident.severity,
        "family": incident.family,
        "cause_key": incident.cause_key,
        "title": incident.title,
        "cause": incident.cause,
        "next_steps": json.loads(incident.next_steps_json),
        "rules": json.loads(incident.rules_json),
        "layers": json.loads(incident.layers_json),
        "findings": json.loads(incident.findings_json),
        "first_step": incident.first_step,
        "last_step": incident.last_step,
        "resolved_step": incident.resolved_step,
        "link": incident.link,
        "created_at": iso_time(incident.created_at),
        "updated_at": iso_time(incident.updated_at),
        "resolved_at": iso_time(incident.resolved_at),
        "notified_at": iso_time(incident.notified_at),
    }


# The incidents a rewind to a checkpoint may cure: a run that diverged, overflowed or met bad data.
REWINDABLE_FAMILIES = ("divergence", "precision", "data")


def with_rewind_points(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each incident document's last_healthy_step, in place: the step before its first evidence, or, for
    an incident a rewind may cure, before the first evidence of any such incident of its run that was
    still active when it began (a divergence warning, then the overflows and the loss out of range: one
    trouble, one rewind point). The guard, the API and the run page all read it from here."""
    for document in documents:
        first = document["first_step"]
        earlier = [
            other["first_step"]
            for other in documents
            if document["family"] in REWINDABLE_FAMILIES
            and other["family"] in REWINDABLE_FAMILIES
            and other.get("run_id") == document.get("run_id")
            and other["first_step"] <= first <= other["last_step"] + 1
        ]
        document["last_healthy_step"] = max(min([first, *earlier]) - 1, -1)
    return documents


def guard_document(incident: Incident) -> dict[str, Any]:
    """An open incident as the run's own agent reads it in a batch's acknowledgement (its guard acts on
    it): what, how bad, where it began, the last healthy step to rewind to, and the batches the
    evidence suspects. No project or run names: the agent knows its run."""
    document = incident_document(incident, "")
    batches: list[Any] = []
    for finding in document["findings"]:
        evidence = finding.get("evidence") if isinstance(finding, dict) else None
        for batch in (evidence or {}).get("batch_ids") or []:
            if batch not in batches and len(batches) < 64:
                batches.append(batch)
    return {key: document[key] for key in GUARD_KEYS} | {
        "last_healthy_step": max(incident.first_step - 1, -1),  # with_rewind_points moves it back
        "suspect_steps": [incident.first_step, incident.last_step],
        "suspect_batches": batches,
    }


# What of the API's incident document the guard reads (no project or run names, no findings).
GUARD_KEYS = (
    "id",
    "status",
    "severity",
    "family",
    "cause_key",
    "title",
    "cause",
    "next_steps",
    "rules",
    "layers",
    "first_step",
    "last_step",
    "link",
)


ONSET_RULES = ("grad_norm_spike", "loss_spike", "loss_divergence", "loss_non_finite")


RunVerdict = Literal["healthy", "warning", "critical"]


def verdict(incidents: Iterable[dict[str, Any]]) -> RunVerdict:
    """A run's health from its incidents: the worst severity of the open ones, else healthy."""
    severities = {i["severity"] for i in incidents if i["status"] == "open"}
    return "critical" if "critical" in severities else "warning" if severities else "healthy"


class Incidents:
    """Groups a run's alerts into incidents and notifies each once (see the module docstring)."""

    def __init__(
        self,
        link: Callable[[Run, int | None], str],
        enqueue: Callable[[Session, list[Any]], None],
        group_wait_steps: int = 10,
        group_wait_s: float = 5.0,
    ) -> None:
        self.link = link
        self.enqueue = enqueue  # called with the new Delivery rows (to wake the outbox after commit)
        self.group_wait_steps = group_wait_steps
        self.group_wait_s = group_wait_s

    # -- membership -------------------------------------------------------------------------------

    def attach(self, session: Session, run: Run, alert: Alert, family: str) -> Incident:
        """The incident an alert that just opened belongs to (an open one that matches, or a new one)."""
        step = alert.step if alert.step is not None else 0
        for incident in alert_tables.open_incidents(session, run.id):
            same_family = incident.family == family
            nearby = (
                family != "liveness"
                and incident.family != "liveness"
                and (
                    incident.first_step - GROUP_WINDOW_STEPS
                    <= step
                    <= incident.first_step + GROUP_WINDOW_STEPS
                )
            )
            # A run that diverged, overflows or computes NaN explains layers that stop learning after it.
            consequence = family == "stalled" and incident.family in ("divergence", "precision", "data")
            # A worse finding after people were told (a NaN loss after a loss-spike warning) must not be
            # folded silently into what they already read: it opens, and notifies, an incident of its own.
            escalates = incident.notified_at is not None and (
                SEVERITY_ORDER.get(alert.severity, 0) > SEVERITY_ORDER.get(incident.severity, 0)
            )
            if (same_family or nearby or consequence) and not escalates:
                alert.incident_id = incident.id
                return incident
        now = time.time()
        incident = Incident(
            project=run.project,
            run_id=run.id,
            family=family,
            status="open",
            severity=alert.severity,
            cause_key=alert.type,
            title=alert.title[:500],
            cause=alert.title,
            next_steps_json="[]",
            rules_json=json.dumps([alert.type]),
            layers_json="[]",
            findings_json="[]",
            first_step=step,
            last_step=step,
            notify_step=step + self.group_wait_steps,
            notify_after=now + self.group_wait_s,
            link=self.link(run, step),
            created_at=now,
            updated_at=now,
        )
        session.add(incident)
        session.flush()
        alert.incident_id = incident.id
        return incident

    def reopen(self, session: Session, incident_id: int | None) -> None:
        """An alert of this incident fired again within its cooldown: the incident is open again."""
        incident = session.get(Incident, incident_id) if incident_id is not None else None
        if incident is not None and incident.status == "resolved":
            incident.status = "open"
            incident.resolved_at = None
            incident.resolved_step = None

    # -- summary and notification -----------------------------------------------------------------

    def refresh(
        self, session: Session, run: Run, incident_ids: set[int], reached_step: int, ended: bool
    ) -> None:
        """Rebuild the summaries of the touched incidents, then notify the run's incidents whose group
        wait is over (the run reached their notify_step, or ended)."""
        for incident_id in sorted(incident_ids):
            incident = session.get(Incident, incident_id)
            if incident is not None:
                self._summarise(session, run, incident)
        if not incident_ids and not alert_tables.has_unnotified_incident(session, run.id):
            return  # the usual batch: nothing waits to be notified (one plain read, no ORM query)
        for incident in alert_tables.unnotified_incidents(session, run.id):
            if ended or (incident.notify_step is not None and reached_step >= incident.notify_step):
                self._notify(session, run, incident, "incident.firing")

    def notify_due(self, session: Session, now: float) -> int:
        """The periodic task: notify open incidents whose wall-clock group wait is over (a run that
        stopped reporting right after a finding still gets its notification)."""
        due = alert_tables.due_incidents(session, now, limit=100)
        for incident in due:
            run = session.get(Run, incident.run_id)
            if run is not None:
                self._summarise(session, run, incident)
                self._notify(session, run, incident, "incident.firing")
        return len(due)

    def _summarise(self, session: Session, run: Run, incident: Incident) -> None:
        alerts = alert_tables.incident_alerts(session, incident.id)
        if not alerts:
            return
        findings = [
            {
                "rule": a.type,
                "title": a.title,
                "step": a.step if a.step is not None else incident.first_step,
                "last_step": a.last_step,
                "severity": a.severity,
                "status": a.status,
                "alert_id": a.id,
                "evidence": json.loads(a.evidence_json),
            }
            for a in alerts
        ][:MAX_FINDINGS]
        context = self.context(session, run, incident.first_step, max(a.last_step or 0 for a in alerts))
        context.recovered_step = _recovered_step(session, run, alerts)
        diagnosis = diagnose(findings, context)
        incident.severity = diagnosis.severity
        incident.cause_key = diagnosis.cause_key[:64]
        incident.title = diagnosis.title[:500]
        incident.cause = diagnosis.cause
        incident.next_steps_json = dump_json({"steps": diagnosis.next_steps})[len('{"steps":') : -1]
        incident.rules_json = json.dumps(
            sorted(
                {a.type for a in alerts},
                key=lambda t: list(RULE_TYPES).index(t) if t in RULE_TYPES else len(RULE_TYPES),
            )
        )
        incident.findings_json = dump_json({"f": findings})[len('{"f":') : -1]
        incident.layers_json = json.dumps(diagnosis.layers[:20])
        # Where it began: a sustained rule's onset or a NaN loss's first step comes before the step it fired.
        incident.first_step = min(finding_onset(f, ONSET_RULES) for f in findings)
        incident.last_step = max(a.last_step or a.step or 0 for a in alerts)
        incident.link = self.link(run, incident.first_step)
        incident.updated_at = time.time()
        if incident.notified_at is not None and incident.cause_key != (
            incident.notified_cause_key or incident.cause_key
        ):
            # People were told one cause and the evidence now names another: tell them (once per change).
            self._notify(session, run, incident, "incident.updated")
        if incident.status == "open" and all(a.status == "resolved" for a in alerts):
            incident.status = "resolved"
            incident.resolved_at = time.time()
            incident.resolved_step = max(
                (a.resolved_step for a in alerts if a.resolved_step is not None), default=None
            )
            if incident.notified_at is not None:
                self._notify(session, run, incident, "incident.resolved")

    def _notify(self, session: Session, run: Run, incident: Incident, event: str) -> None:
        if event == "incident.firing":
            if incident.notified_at is not None:
                return
            incident.notified_at = time.time()
        if event in ("incident.firing", "incident.updated"):
            incident.notified_cause_key = incident.cause_key
        webhooks = alert_tables.enabled_webhooks(session, run.project)
        if event == "incident.resolved":
            webhooks = [w for w in webhooks if w.send_resolved]
        if not webhooks:
            return
        document = json.loads(dump_json(incident_document(incident, run.name)))
        # A webhook is its project's: the run as the project names it (its link names the project too).
        document["run_id"] = run.requested_id or run.id
        now = time.time()
        rows = [
            Delivery(
                webhook_id=webhook.id,
                alert_id=None,
                incident_id=incident.id,
                event=event,
                payload=render(webhook.format, event, document),
                status="pending",
                attempts=0,
                next_attempt_at=now,
                created_at=now,
            )
            for webhook in webhooks
        ]
        session.add_all(rows)
        self.enqueue(session, rows)

    # -- what the run showed ----------------------------------------------------------------------

    @staticmethod
    def context(session: Session, run: Run, first_step: int, last_step: int) -> RunContext:
        """The run's misuse events, lr around the incident, loss scale, safe-scale band and clip settings."""
        keys = (
            "lr",
            "loss",
            "amp/loss",
            "amp/scale",
            "amp/safe_scale_min",
            "amp/safe_scale_max",
            "amp/micro_batches",
            "grad/clip_max_norm",
            "param/max_abs",
        )
        series = alert_tables.series_ids(session, run.id, keys)

        def points(
            key: str, start: int, end: int, limit: int = 200, latest: bool = False
        ) -> list[tuple[int, float]]:
            if key not in series:
                return []
            if latest:
                found = chunked_points.latest(session, series[key], 0, end)
                return [] if found is None or found[0] < start else [found]
            first = chunked_points.read_first(session, series[key], 0, start, end + 1, limit)
            return list(zip(first.steps.tolist(), first.values.tolist(), strict=True))

        def latest(key: str, at: int) -> float | None:
            found = points(key, -1, at, limit=1, latest=True)
            return found[0][1] if found else None

        misuse: dict[str, dict[str, Any]] = {}
        for kind, data in events_of_kinds(session, run.id, MISUSE_EVENTS, limit=20):
            misuse.setdefault(kind, data)
        low, high = latest("amp/safe_scale_min", last_step), latest("amp/safe_scale_max", last_step)
        lr_start = first_step - 60
        lr_peak_before, lr_points_before = None, 0
        if "lr" in series:
            lr_points_before, lr_peak_before = chunked_points.count_and_max_before(
                session, series["lr"], 0, lr_start
            )
        max_abs: list[tuple[str, float]] = []
        if "param/max_abs" in series:
            row = alert_tables.first_vector(session, series["param/max_abs"])
            if row is not None:
                # The run's layer list may have changed since: pair what both name.
                max_abs = list(zip(json.loads(run.layers_json), unpack(row, "d"), strict=False))
        return RunContext(
            fp16_scaler="amp/scale" in series,
            misuse=misuse,
            lr=points("lr", lr_start, max(first_step, last_step) + 1),
            loss=points("loss" if "loss" in series else "amp/loss", lr_start, first_step + 1),
            reached_step=run.last_step,
            lr_peak_before=lr_peak_before,
            lr_points_before=int(lr_points_before or 0),
            max_abs_weights=max_abs,
            scale=latest("amp/scale", first_step),
            safe_scale=(low, high) if low is not None and high is not None else None,
            micro_batches=latest("amp/micro_batches", last_step),
            clip_max_norm=latest("grad/clip_max_norm", last_step),
        )
