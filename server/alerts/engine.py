"""The alert engine: feeds each stored batch to the rules of its run, inside the ingest transaction,
turns findings into alerts, and alerts into incidents (incidents.py), which are what is notified.

Exactly once per batch: Store.ingest calls after_ingest() only for a batch it has not seen, in the
same transaction that stores it, so a crash loses both or neither. Evaluator state lives per
(rule, run) in alert_rule_states; concurrent batches of one run are serialised by the runs-row update
that ingest makes before calling us (and the state rows are read FOR UPDATE on PostgreSQL).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from sqlalchemy import event
from sqlalchemy.orm import Session

from ..errors import TooLarge
from ..models import Alert, AlertRule, AlertRuleState, Run
from ..schemas import BatchIn
from ..storage import alerts as alert_tables
from ..storage.alerts import RuleRow
from ..storage.codecs import dump_json, iso_time
from ..storage.liveness import NO_HEARTBEAT
from ..storage.queries import events_of_kinds
from .advice import EXPLAINED_BY_MISUSE, HINTS, alert_hint
from .evidence import HeartbeatEvidence
from .incidents import Incidents
from .rules import (
    CLEAR,
    DEFAULT_RULES,
    MISUSE_EVENTS,
    RULE_TYPES,
    Finding,
    RuleType,
    StepData,
    Verdict,
    make_rule,
)
from .steps import complete_steps, last_step, step_data

__all__ = ["HINTS", "AlertEngine", "alert_document", "step_data"]

logger = logging.getLogger("gradwatch.alerts")

_MAX_BUILT_RULES = 4096  # rule objects kept by (type, parameters); more clear the cache
# Steps fed to rules for one batch, summed over the rules (a batch of 100 steps on a project with the
# 19 default rules: ~1,900; a batch of 5,000 steps of a loss, read by 6 of them, is over the cap).
# Evaluation runs inside the batch's transaction, so on SQLite it holds the one write lock every other
# tenant waits for: ~5 us per rule and step on two busy cores, so the most one
# batch may ask is ~0.1 s (100,000 rule-steps held it ~0.1-0.4 s, and another tenant's batch arriving
# then waited: its p95 5.8x its p95 alone, bench/ingest_isolation.py). A batch over it is refused
# whole (413, nothing stored) and the agent sends it again in halves; without the cap, one batch at
# the points cap on a project with many rules held the lock for minutes (issue 28).
MAX_RULE_EVALUATIONS_PER_BATCH = 25_000


def alert_document(alert: Alert, run_name: str) -> dict[str, Any]:
    """An alert as the API returns it and webhooks carry it."""
    return {
        "id": alert.id,
        "project": alert.project,
        "run_id": alert.run_id,
        "run_name": run_name,
        "rule_id": alert.rule_id,
        "type": alert.type,
        "severity": alert.severity,
        "status": alert.status,
        "step": alert.step,
        "last_step": alert.last_step,
        "resolved_step": alert.resolved_step,
        "occurrences": alert.occurrences,
        "title": alert.title,
        "hint": alert.hint,
        "evidence": json.loads(alert.evidence_json),
        "link": alert.link,
        "incident_id": alert.incident_id,
        "created_at": iso_time(alert.created_at),
        "resolved_at": iso_time(alert.resolved_at),
        "acknowledged_at": iso_time(alert.acknowledged_at),
    }


class AlertEngine:
    """Evaluates rules on ingest (after_ingest) and on the clock (check_heartbeats); records alerts
    and enqueues their webhook deliveries in the caller's transaction."""

    def __init__(
        self,
        public_url: str,
        on_enqueued: Callable[[], None] | None = None,
        group_wait_steps: int = 10,
        group_wait_s: float = 5.0,
    ) -> None:
        self.public_url = public_url.rstrip("/")
        self.on_enqueued = on_enqueued  # called after a commit that enqueued deliveries
        self._projects_ready: set[str] = set()
        self._built: dict[tuple[str, str], RuleType[Any]] = {}  # (type, params_json) -> rule (see _rules)
        self._planned = threading.local()  # .plan: (batch, rules, work) from before_ingest
        self.incidents = Incidents(
            self.link,
            lambda session, _rows: self.notify_after_commit(session),
            group_wait_steps=group_wait_steps,
            group_wait_s=group_wait_s,
        )

    # -- rules of a project -----------------------------------------------------------------------

    def ensure_defaults(self, session: Session, project: str) -> None:
        """Install DEFAULT_RULES the first time a project is seen (recorded in alert_projects)."""
        if project in self._projects_ready:
            return
        now = time.time()
        if alert_tables.claim_project(session, project, now):
            for rule_type in DEFAULT_RULES:
                session.add(
                    AlertRule(
                        project=project,
                        run_id=None,
                        type=rule_type,
                        name=rule_type.replace("_", " "),
                        params_json=json.dumps(RULE_TYPES[rule_type]().values),
                        enabled=True,
                        cooldown_steps=RULE_TYPES[rule_type].cooldown_steps,
                        created_at=now,
                        updated_at=now,
                    )
                )
            session.flush()
        # Known only once it has committed: a batch refused after this (413, a lock timeout) rolls the
        # defaults back with it, and the project's next batch must install them again.
        ready = self._projects_ready

        def _installed(_session: Session) -> None:
            ready.add(project)

        event.listen(session, "after_commit", _installed, once=True)

    def forget_project(self, project: str) -> None:
        self._projects_ready.discard(project)

    def _rules(self, session: Session, project: str, run_id: str) -> list[tuple[RuleRow, RuleType[Any]]]:
        """The enabled rules of a run (its project's and its own), read as plain rows on every batch
        (rules change through the API, maybe on another replica); each rule type is built once per
        (type, parameters) and reused (rule objects hold parameters only, state lives in the rows)."""
        rules = []
        for row in alert_tables.enabled_rules(session, project, run_id):
            key = (row.type, row.params_json)
            rule = self._built.get(key)
            if rule is None:
                try:
                    rule = make_rule(row.type, json.loads(row.params_json))
                except (ValueError, TypeError):
                    logger.exception(
                        "gradwatch: alert rule %d (%s) has invalid parameters; skipped", row.id, row.type
                    )
                    continue
                if len(self._built) >= _MAX_BUILT_RULES:
                    self._built.clear()
                self._built[key] = rule
            rules.append((row, rule))
        return rules

    # -- evaluation on ingest ---------------------------------------------------------------------

    def _plan(
        self, session: Session, run: Run, batch: BatchIn
    ) -> tuple[list[tuple[RuleRow, RuleType[Any]]], list[tuple[RuleRow, RuleType[Any], list[StepData]]]]:
        """The enabled rules of the batch's run and, for each rule that reads anything in the batch, the
        steps it is fed (in step order)."""
        self.ensure_defaults(session, run.project)
        rules = self._rules(session, run.project, run.id)
        if not rules:
            return rules, []
        scalar_keys = {k for _, rule in rules for k in rule.scalar_keys} | {"amp/skipped"}
        vector_keys = {k for _, rule in rules for k in rule.vector_keys} | {
            rule.key for _, rule in rules if "key" in rule.values
        }
        # Steps grouped by what they hold: each rule is asked once per kind of step, not once per step.
        kinds: dict[tuple[int, frozenset[str]], list[StepData]] = {}
        for data in step_data(batch, scalar_keys, vector_keys):
            kinds.setdefault((data.rank, data.signature()), []).append(data)
        work = []
        for row, rule in rules:
            wanted = [
                group for (rank, present), group in kinds.items() if rule.reads_signature(rank, present)
            ]
            if wanted:
                fed = (
                    wanted[0]
                    if len(wanted) == 1
                    else sorted((data for group in wanted for data in group), key=lambda d: (d.step, d.rank))
                )
                work.append((row, rule, fed[-1:] if rule.periodic else fed))  # the clock's rules: "alive"
        return rules, work

    def before_ingest(self, session: Session, run: Run, batch: BatchIn) -> None:
        """Refuse a batch whose evaluation would hold the ingest transaction too long (TooLarge), before
        that transaction begins; the plan is kept (per thread) for this batch's after_ingest."""
        rules, work = self._plan(session, run, batch)
        evaluations = sum(len(fed) for _, _, fed in work)
        if evaluations > MAX_RULE_EVALUATIONS_PER_BATCH:
            raise TooLarge(
                f"the batch has more steps than its project's {len(work)} alert rules may evaluate at"
                f" once: {evaluations:,} rule-steps, at most {MAX_RULE_EVALUATIONS_PER_BATCH:,} per"
                " batch; nothing was stored: send fewer steps per batch (the agent splits it)",
                "rule_evaluations",
            )
        self._planned.plan = (batch, rules, work)

    def after_ingest(self, session: Session, run_id: str, batch: BatchIn) -> None:
        """Evaluate a newly stored batch (Store.ingest's hook, inside its transaction)."""
        run = session.get(Run, run_id)
        assert run is not None
        planned = getattr(self._planned, "plan", None)
        self._planned.plan = None
        if planned is not None and planned[0] is batch:
            rules, work = planned[1], planned[2]
        else:  # a batch this engine did not see before (or one a resume rewrote since)
            rules, work = self._plan(session, run, batch)
        ended = batch.status is not None and batch.status != "running"
        touched: set[int] = set()
        resume = next((e for e in batch.events if e.kind == "resume"), None)
        if rules and resume is not None:
            self._rewind(session, run.id, rules, batch.rank, resume.step)
        if rules:
            if ended:
                self._run_ended(session, run, [(row, rule) for row, rule in rules if rule.periodic], touched)
            layers = batch.layers if batch.layers is not None else json.loads(run.layers_json)
            # Every state this batch needs, locked in one query (in rule order, the same in every process),
            # read and written as plain rows: one SELECT and one UPDATE for all of them.
            # The run's last batch: what a rule holds of a step (see complete_steps) is evaluated now.
            if ended:
                fed_rules = {row.id for row, _, _ in work}
                unfed = [(row, rule) for row, rule in rules if row.id not in fed_rules and not rule.periodic]
                work = [*work, *((row, rule, []) for row, rule in unfed)]
            states: dict[int, str] = {}
            if work:
                session.flush()  # what _rewind and _run_ended changed: the read below bypasses the ORM
                states = alert_tables.read_rule_states(session, [row.id for row, _, _ in work], run_id)
            written = []
            for row, rule, fed in work:
                stored = states.get(row.id)
                if stored is None and not fed:
                    continue
                document = self._evaluate(session, run, row, rule, fed, layers, stored, touched, ended)
                if stored is not None and document is not None:
                    written.append((document, time.time(), row.id, run_id))
            if written:
                session.flush()  # ORM changes of this batch first (alerts, new states), then the states
                alert_tables.write_rule_states(session, written)
        self.incidents.refresh(session, run, touched, last_step(batch), ended)

    def _rewind(
        self, session: Session, run_id: str, rules: list[tuple[RuleRow, RuleType[Any]]], rank: int, step: int
    ) -> None:
        """A resumed run (a `resume` event at `step`): its steps from there on are a new attempt. Each
        rule starts over as on a new run (the scaler calibrates again, windows refill: a restored loss
        scale is not a scale event, the abandoned attempt's values are no baseline), and the steps from
        `step` on are evaluated even where the abandoned attempt had reached further. Open alerts stay
        open until their rule clears them."""
        states = alert_tables.lock_rule_states(session, [row.id for row, _ in rules], run_id)
        by_rule = {row.id: rule for row, rule in rules}
        for state in states:
            document = json.loads(state.state_json)
            document["eval"] = by_rule[state.rule_id].initial_state()
            document.pop("held", None)
            document["last"] = {r: s for r, s in document["last"].items() if r != str(rank)}
            if step > 0:
                document["last"][str(rank)] = step - 1
            state.state_json = json.dumps(document)
            state.updated_at = time.time()

    def _run_ended(
        self, session: Session, run: Run, periodic: list[tuple[RuleRow, RuleType[Any]]], touched: set[int]
    ) -> None:
        """A finished (or crashed) run is no longer expected to report: its heartbeat alerts resolve."""
        for row, rule in periodic:
            state = self._load_state(session, row, rule, run.id)
            document = json.loads(state.state_json)
            if document["alert"] is not None:
                self._resolve(session, document, run.last_step, touched)
                state.state_json = json.dumps(document)
                state.updated_at = time.time()

    def _load_state(
        self, session: Session, rule_row: RuleRow | AlertRule, rule: RuleType[Any], run_id: str
    ) -> AlertRuleState:
        document = {
            "eval": rule.initial_state(),
            "last": {},
            "alert": None,
            "last_alert": None,
            "fired_step": None,
        }
        return alert_tables.rule_state_or_new(session, rule_row.id, run_id, json.dumps(document), time.time())

    def _evaluate(
        self,
        session: Session,
        run: Run,
        row: RuleRow | AlertRule,
        rule: RuleType[Any],
        fed: list[StepData],
        layers: list[str],
        stored: str | None,
        touched: set[int],
        final: bool = False,
    ) -> str | None:
        """Feed a rule its steps; returns the new state (JSON) to write for a stored state, None when
        there is nothing to write (the rule failed; or the state is new, added to the session here).
        final: the run's last batch (nothing of a step is held for a later one)."""
        state = None
        if stored is None:
            state = self._load_state(session, row, rule, run.id)
            stored = state.state_json
        document = json.loads(stored)
        last = document["last"]
        verdicts: list[tuple[int, Verdict]] = []
        observe, evaluation = rule.observe, document["eval"]
        if not rule.periodic:
            fed = complete_steps(document, rule, fed, final)
        try:  # pure: a failing rule is logged and skipped, it never blocks ingest
            for data in fed:
                rank = str(data.rank)
                if data.step <= last.get(rank, -1):
                    continue  # a replayed or out-of-order step was evaluated already
                last[rank] = data.step
                verdict = observe(evaluation, data, layers)
                if verdict is not None and (
                    verdict is not CLEAR or document["alert"] is not None or verdicts
                ):
                    verdicts.append((data.step, verdict))
        except Exception:
            logger.exception(
                "gradwatch: alert rule %d (%s) failed on run %s; skipped", row.id, row.type, run.id
            )
            return None
        # Findings while the rule's alert is open only count on it: one UPDATE for a run of them, not
        # one per step (a batch on which a rule fires at every step would hold the write lock for each).
        repeats: list[Finding] = []
        for step, verdict in verdicts:
            if isinstance(verdict, Finding) and document["alert"] is not None:
                repeats.append(verdict)
                continue
            self._count_repeats(session, run, document, repeats, touched)
            repeats = []
            if isinstance(verdict, Finding):
                self._fire(session, run, row, rule, document, verdict, touched)
            elif verdict is CLEAR and document["alert"] is not None:
                self._resolve(session, document, step, touched)
        self._count_repeats(session, run, document, repeats, touched)
        if state is None:
            return json.dumps(document)
        state.state_json = json.dumps(document)
        state.updated_at = time.time()
        return None

    # -- alerts -----------------------------------------------------------------------------------

    def _fire(
        self,
        session: Session,
        run: Run,
        row: RuleRow | AlertRule,
        rule: RuleType[Any],
        document: dict[str, Any],
        finding: Finding,
        touched: set[int],
    ) -> None:
        if document["alert"] is not None:
            self._count_repeats(session, run, document, [finding], touched)
            return
        evidence = dump_json(finding.evidence | {"link": self.link(run, finding.step)})
        previous = document.get("last_alert")
        fired = document.get("fired_step")
        if previous is not None and fired is not None and finding.step < fired + row.cooldown_steps:
            # Within the cooldown: the previous alert opens again, without a new notification.
            reopened = alert_tables.reopen_alert(
                session,
                previous,
                _open_key(row.id, run.id),
                finding.step,
                finding.title[:500],  # this finding's numbers, not the previous opening's
                evidence,
            )
            if reopened:
                document["alert"] = previous
                self.incidents.reopen(session, document.get("incident"))
                if document.get("incident") is not None:
                    touched.add(document["incident"])
                return
        alert = Alert(
            rule_id=row.id,
            run_id=run.id,
            project=run.project,
            type=rule.name,
            severity=rule.severity,
            status="firing",
            open_key=_open_key(row.id, run.id),
            step=finding.step,
            last_step=finding.step,
            occurrences=1,
            title=finding.title[:500],
            hint=self._hint(session, run.id, rule.name, finding),
            evidence_json=evidence,
            link=self.link(run, finding.step),
            created_at=time.time(),
            resolution_notified=False,
        )
        session.add(alert)
        session.flush()
        incident = self.incidents.attach(session, run, alert, rule.family)
        document["alert"] = document["last_alert"] = alert.id
        document["incident"] = incident.id
        document["fired_step"] = finding.step
        touched.add(incident.id)

    def _count_repeats(
        self, session: Session, run: Run, document: dict[str, Any], repeats: list[Finding], touched: set[int]
    ) -> None:
        """De-duplicated findings: the open alert counts them and shows the latest one."""
        if not repeats:
            return
        latest = repeats[-1]
        alert_tables.count_repeats(
            session,
            document["alert"],
            len(repeats),
            latest.step,
            latest.title[:500],
            dump_json(latest.evidence | {"link": self.link(run, latest.step)}),
        )
        if document.get("incident") is not None:
            touched.add(document["incident"])

    def _resolve(
        self, session: Session, document: dict[str, Any], step: int | None, touched: set[int]
    ) -> None:
        alert = session.get(Alert, document["alert"])
        document["alert"] = None
        if alert is None or alert.status != "firing":
            return
        alert.status = "resolved"
        alert.open_key = None
        alert.resolved_at = time.time()
        alert.resolved_step = step
        alert.resolution_notified = True  # incidents notify; an alert's own resolution is not sent
        session.flush()
        if alert.incident_id is not None:
            touched.add(alert.incident_id)

    def link(self, run: Run, step: int | None) -> str:
        """The run page (at `step`), named as its project names the run and with the project, so that it
        opens the right run for whoever follows it (two projects may each have a run of that id; a
        token for every project reads ?project= to tell which: deps.authorize_run)."""
        own_id, project = run.requested_id or run.id, quote(run.project, safe="")
        page = f"{self.public_url}/dashboard/runs/{own_id}?project={project}"
        return page if step is None else f"{page}&step={step}"

    def _hint(self, session: Session, run_id: str, rule_name: str, finding: Finding) -> str:
        misuse_hints: dict[str, str] = {}
        if rule_name in EXPLAINED_BY_MISUSE:
            for kind, data in events_of_kinds(session, run_id, MISUSE_EVENTS, limit=len(MISUSE_EVENTS) * 2):
                hint = data.get("hint")
                if isinstance(hint, str) and kind not in misuse_hints:
                    misuse_hints[kind] = hint
        return alert_hint(rule_name, finding.cause, misuse_hints)

    def notify_after_commit(self, session: Session) -> None:
        if self.on_enqueued is not None and not session.info.get("gradwatch_notify"):
            session.info["gradwatch_notify"] = True
            callback = self.on_enqueued

            def _after_commit(_session: Session) -> None:
                callback()

            event.listen(session, "after_commit", _after_commit, once=True)

    # -- evaluation on the clock ------------------------------------------------------------------

    def check_heartbeats(self, session: Session, now: float) -> int:
        """Open a heartbeat alert for each running run silent for longer than its rule's timeout (a run
        the server marked crashed for that silence, NO_HEARTBEAT, still counts as running here)."""
        opened = 0
        for row in alert_tables.enabled_rules_of_type(session, "heartbeat"):
            rule = make_rule(row.type, json.loads(row.params_json))
            for run in alert_tables.silent_runs(session, row, now - rule.timeout_s, NO_HEARTBEAT):
                state = self._load_state(session, row, rule, run.id)
                document = json.loads(state.state_json)
                if document["alert"] is not None:
                    continue
                silent = now - run.updated_at
                finding = Finding(
                    run.last_step if run.last_step is not None else 0,
                    f"no data for {silent / 60:.0f} min (last step {run.last_step})",
                    HeartbeatEvidence(
                        steps=[run.last_step],
                        last_seen=iso_time(run.updated_at),
                        silent_s=round(silent, 1),
                    ),
                )
                touched: set[int] = set()
                self._fire(session, run, row, rule, document, finding, touched)
                state.state_json = json.dumps(document)
                state.updated_at = now
                self.incidents.refresh(session, run, touched, -1, ended=True)  # nothing more to wait for
                opened += 1
        return opened

    def notify_due_incidents(self, session: Session, now: float) -> int:
        """The periodic task: incidents whose wall-clock group wait is over are notified."""
        return self.incidents.notify_due(session, now)


def _open_key(rule_id: int, run_id: str) -> str:
    return f"{rule_id}/{run_id}"
