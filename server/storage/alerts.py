"""The alerts' tables (alert rules and their per-run states, alerts, incidents, webhooks, deliveries):
every SQL statement gradwatch.server.alerts runs, each in the caller's session and transaction.

    rules and states    what evaluation on ingest reads and writes per batch (plain rows, one SELECT
                        and one UPDATE for all the states of a batch), the heartbeat's silent runs
    alerts              an alert reopened or counting repeats; a rule restarted
    incidents           open and due incidents, their alerts, what the run showed around them
    deliveries          the outbox: a claim (FOR UPDATE SKIP LOCKED on PostgreSQL) and its outcome
    pages               the API's filtered, counted lists

Rows come back as the ORM objects of gradwatch.server.models where the caller changes them in the
same transaction (an alert's incident, a rule's state), else as plain tuples.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from sqlalchemy import CursorResult, Row, and_, delete, func, literal, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql import Select

from ..models import (
    Alert,
    AlertProject,
    AlertRule,
    AlertRuleState,
    Delivery,
    Incident,
    Run,
    Series,
    VectorPoint,
    Webhook,
)
from . import bulk

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

__all__ = [
    "RuleRow",
    "alerts_page",
    "claim_delivery",
    "claim_project",
    "count_repeats",
    "count_rules",
    "delete_deliveries",
    "deliveries_page",
    "detach_alerts",
    "due_incidents",
    "enabled_rules",
    "enabled_rules_of_type",
    "enabled_webhooks",
    "finish_delivery",
    "first_vector",
    "has_unnotified_incident",
    "incident_alerts",
    "incidents_page",
    "lock_rule_states",
    "open_incidents",
    "read_rule_states",
    "reopen_alert",
    "restart_rule",
    "rule_state",
    "rule_state_or_new",
    "rules",
    "run_incidents",
    "series_ids",
    "silent_runs",
    "skipped_since",
    "unnotified_incidents",
    "webhooks",
    "write_rule_states",
]


# -- rules and their states -----------------------------------------------------------------------


class RuleRow(NamedTuple):
    """What evaluation on ingest reads of an alert rule's row."""

    id: int
    type: str
    params_json: str
    cooldown_steps: int


def claim_project(session: Session, project: str, now: float) -> bool:
    """Record a project in alert_projects; True when this call recorded it (its default rules are then
    the caller's to add), False when it was known."""
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    created = session.execute(
        insert(AlertProject)
        .values(project=project, created_at=now)
        .on_conflict_do_nothing()
        .returning(AlertProject.project)
    ).first()
    return created is not None


def enabled_rules(session: Session, project: str, run_id: str) -> list[RuleRow]:
    """The enabled rules of a run (its project's and its own) as plain rows, in id order."""
    rows = bulk.execute(
        session,
        "SELECT id, type, params_json, cooldown_steps FROM alert_rules WHERE project = ? AND enabled = ?"
        " AND (run_id IS NULL OR run_id = ?) ORDER BY id",
        [project, True, run_id],
    )
    return list(map(RuleRow._make, rows))


def read_rule_states(session: Session, rule_ids: list[int], run_id: str) -> dict[int, str]:
    """rule id -> state JSON of these rules on a run, locked (FOR UPDATE on PostgreSQL) in rule order,
    the same in every process. The read bypasses the ORM: flush before it."""
    lock = " FOR UPDATE" if session.get_bind().dialect.name == "postgresql" else ""
    return dict(
        bulk.execute(
            session,
            f"SELECT rule_id, state_json FROM alert_rule_states WHERE rule_id IN"
            f" ({', '.join('?' for _ in rule_ids)}) AND run_id = ? ORDER BY rule_id{lock}",
            [*rule_ids, run_id],
        )
    )


def write_rule_states(session: Session, states: list[tuple[str, float, int, str]]) -> None:
    """(state JSON, updated_at, rule id, run id) of states read by read_rule_states: one UPDATE."""
    bulk.execute(
        session,
        "UPDATE alert_rule_states SET state_json = ?, updated_at = ? WHERE rule_id = ? AND run_id = ?",
        states,
    )


def lock_rule_states(session: Session, rule_ids: list[int], run_id: str) -> Sequence[AlertRuleState]:
    """The states of these rules on a run, locked FOR UPDATE in rule order (the order every ingest uses)."""
    return session.scalars(
        select(AlertRuleState)
        .where(AlertRuleState.rule_id.in_(rule_ids), AlertRuleState.run_id == run_id)
        .order_by(AlertRuleState.rule_id)
        .with_for_update()
    ).all()


def rule_state(session: Session, rule_id: int, run_id: str) -> AlertRuleState | None:
    """One rule's state on a run, locked FOR UPDATE; None before its first evaluation."""
    return session.scalars(
        select(AlertRuleState)
        .where(AlertRuleState.rule_id == rule_id, AlertRuleState.run_id == run_id)
        .with_for_update()
    ).first()


def rule_state_or_new(
    session: Session, rule_id: int, run_id: str, state_json: str, now: float
) -> AlertRuleState:
    """One rule's state on a run, locked FOR UPDATE; first created with `state_json` when there is none.
    Two transactions may both find none (the heartbeat check on the server's clock and an ingest of
    the same run): the insert does nothing for the second, which waits for the first and reads its
    state, instead of failing the batch on the unique key."""
    state = rule_state(session, rule_id, run_id)
    if state is None:
        bulk.execute(
            session,
            "INSERT INTO alert_rule_states (rule_id, run_id, state_json, updated_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [rule_id, run_id, state_json, now],
        )
        state = rule_state(session, rule_id, run_id)
        if state is None:  # the row exists now, ours or the other's: only a deleted rule or run is missing
            raise RuntimeError(f"alert rule state ({rule_id}, {run_id!r}) vanished while created")
    return state


def enabled_rules_of_type(session: Session, rule_type: str) -> Sequence[AlertRule]:
    """Every enabled rule of a type, in every project, in id order."""
    return session.scalars(
        select(AlertRule)
        .where(AlertRule.type == rule_type, AlertRule.enabled.is_(True))
        .order_by(AlertRule.id)
    ).all()


def silent_runs(session: Session, rule: AlertRule, silent_since: float, crashed_reason: str) -> Sequence[Run]:
    """The runs a heartbeat rule watches (its project's, or its one run) that are running (or marked
    crashed for `crashed_reason`), have reported nothing since `silent_since` (epoch seconds) and have
    no open alert of this rule; at most 1,000, in id order."""
    already_open = select(Alert.id).where(Alert.open_key == literal(f"{rule.id}/") + Run.id).exists()
    query = select(Run).where(
        Run.project == rule.project,
        or_(
            Run.status == "running",
            and_(Run.status == "crashed", Run.status_reason == crashed_reason),
        ),
        Run.updated_at < silent_since,
        ~already_open,
    )
    if rule.run_id is not None:
        query = query.where(Run.id == rule.run_id)
    return session.scalars(query.order_by(Run.id).limit(1000)).all()


def count_rules(session: Session, project: str) -> int:
    """How many alert rules a project holds (disabled ones too)."""
    return session.scalar(select(func.count()).where(AlertRule.project == project)) or 0


def rules(session: Session, project: str | None, run_id: str | None) -> Sequence[AlertRule]:
    """The rules of a project (None: every project) that apply to a run (None: all), in id order."""
    query = select(AlertRule)
    if run_id is not None:
        query = query.where((AlertRule.run_id.is_(None)) | (AlertRule.run_id == run_id))
    if project is not None:
        query = query.where(AlertRule.project == project)
    return session.scalars(query.order_by(AlertRule.id)).all()


def restart_rule(session: Session, rule_id: int, now: float) -> None:
    """A rule starts over: its states are dropped and its firing alerts resolved."""
    session.execute(delete(AlertRuleState).where(AlertRuleState.rule_id == rule_id))
    session.execute(
        update(Alert)
        .where(Alert.rule_id == rule_id, Alert.status == "firing")
        .values(status="resolved", open_key=None, resolved_at=now)
    )


def detach_alerts(session: Session, rule_id: int) -> None:
    """The alerts of a rule being deleted outlive it, with no rule."""
    session.execute(update(Alert).where(Alert.rule_id == rule_id).values(rule_id=None))


# -- alerts ---------------------------------------------------------------------------------------


def reopen_alert(
    session: Session, alert_id: int, open_key: str, step: int, title: str, evidence_json: str
) -> bool:
    """Open a resolved alert again with a new finding's step, title and evidence (one more
    occurrence); False when it is not resolved (or gone)."""
    result = session.execute(
        update(Alert)
        .where(Alert.id == alert_id, Alert.status == "resolved")
        .values(
            status="firing",
            open_key=open_key,
            resolved_at=None,
            resolved_step=None,
            occurrences=Alert.occurrences + 1,
            last_step=step,
            title=title,
            evidence_json=evidence_json,
        )
    )
    return bool(cast("CursorResult[Any]", result).rowcount)  # an UPDATE's result is a CursorResult


def count_repeats(
    session: Session, alert_id: int, repeats: int, step: int, title: str, evidence_json: str
) -> None:
    """An open alert counts `repeats` more findings and shows the latest one."""
    session.execute(
        update(Alert)
        .where(Alert.id == alert_id)
        .values(
            occurrences=Alert.occurrences + repeats,
            last_step=step,
            title=title,
            evidence_json=evidence_json,
        )
    )


def alerts_page(
    session: Session,
    project: str | None,
    run_id: str | None,
    status: str | None,
    acknowledged: bool | None,
    limit: int,
    offset: int,
) -> tuple[list[Row[Alert, str]], int]:
    """(alert, run name) newest first, and how many match before limit/offset."""
    query = select(Alert, Run.name).join(Run, Run.id == Alert.run_id)
    if project is not None:
        query = query.where(Alert.project == project)
    if run_id is not None:
        query = query.where(Alert.run_id == run_id)
    if status is not None:
        query = query.where(Alert.status == status)
    if acknowledged is not None:
        query = query.where(
            Alert.acknowledged_at.is_not(None) if acknowledged else Alert.acknowledged_at.is_(None)
        )
    total = _count(session, query)
    rows = session.execute(query.order_by(Alert.id.desc()).limit(limit).offset(offset)).all()
    return list(rows), total


# -- incidents ------------------------------------------------------------------------------------


def open_incidents(session: Session, run_id: str) -> Sequence[Incident]:
    return session.scalars(
        select(Incident).where(Incident.run_id == run_id, Incident.status == "open").order_by(Incident.id)
    ).all()


def has_unnotified_incident(session: Session, run_id: str) -> bool:
    """Whether an open incident of the run waits to be notified (one plain read, no ORM query)."""
    return bool(
        bulk.execute(
            session,
            "SELECT 1 FROM incidents WHERE run_id = ? AND status = 'open' AND notified_at IS NULL LIMIT 1",
            [run_id],
        )
    )


def unnotified_incidents(session: Session, run_id: str) -> Sequence[Incident]:
    """The run's open incidents not notified yet, locked FOR UPDATE, in id order."""
    return session.scalars(
        select(Incident)
        .where(Incident.run_id == run_id, Incident.status == "open", Incident.notified_at.is_(None))
        .order_by(Incident.id)
        .with_for_update()
    ).all()


def due_incidents(session: Session, now: float, limit: int = 100) -> Sequence[Incident]:
    """Open incidents not notified whose wall-clock group wait is over at `now`, locked FOR UPDATE
    SKIP LOCKED (another replica's are left to it)."""
    return session.scalars(
        select(Incident)
        .where(Incident.notified_at.is_(None), Incident.status == "open", Incident.notify_after <= now)
        .order_by(Incident.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()


def incident_alerts(session: Session, incident_id: int) -> Sequence[Alert]:
    """An incident's alerts in step order."""
    return session.scalars(
        select(Alert).where(Alert.incident_id == incident_id).order_by(Alert.step, Alert.id)
    ).all()


def run_incidents(session: Session, run_id: str) -> Sequence[Incident]:
    """A run's incidents, newest first."""
    return session.scalars(
        select(Incident).where(Incident.run_id == run_id).order_by(Incident.id.desc())
    ).all()


def incidents_page(
    session: Session, project: str | None, run_id: str | None, status: str | None, limit: int, offset: int
) -> tuple[list[Row[Incident, str]], int]:
    """(incident, run name) newest first, and how many match before limit/offset."""
    query = select(Incident, Run.name).join(Run, Run.id == Incident.run_id)
    if project is not None:
        query = query.where(Incident.project == project)
    if run_id is not None:
        query = query.where(Incident.run_id == run_id)
    if status is not None:
        query = query.where(Incident.status == status)
    total = _count(session, query)
    rows = session.execute(query.order_by(Incident.id.desc()).limit(limit).offset(offset)).all()
    return list(rows), total


def skipped_since(session: Session, run_id: str, step: int) -> bool:
    """Whether the run skipped an optimizer step (a `skip` event) after `step`."""
    return bool(
        bulk.execute(
            session,
            "SELECT 1 FROM events WHERE run_id = ? AND kind = 'skip' AND step > ? LIMIT 1",
            [run_id, step],
        )
    )


def series_ids(session: Session, run_id: str, keys: Sequence[str]) -> dict[str, int]:
    """key -> series id of those of `keys` the run has."""
    return dict(
        session.execute(
            select(Series.key, Series.id).where(Series.run_id == run_id, Series.key.in_(keys))
        ).all()
    )


def first_vector(session: Session, series_id: int) -> bytes | None:
    """Rank 0's first stored row of a vector series (packed), or None."""
    return session.execute(
        select(VectorPoint.data)
        .where(VectorPoint.series_id == series_id, VectorPoint.rank == 0)
        .order_by(VectorPoint.step)
        .limit(1)
    ).scalar()


# -- webhooks and deliveries ----------------------------------------------------------------------


def enabled_webhooks(session: Session, project: str) -> Sequence[Webhook]:
    return session.scalars(
        select(Webhook).where(Webhook.project == project, Webhook.enabled.is_(True)).order_by(Webhook.id)
    ).all()


def webhooks(session: Session, project: str | None) -> Sequence[Webhook]:
    """The webhooks of a project (None: every project), in id order."""
    query = select(Webhook)
    if project is not None:
        query = query.where(Webhook.project == project)
    return session.scalars(query.order_by(Webhook.id)).all()


def delete_deliveries(session: Session, webhook_id: int) -> None:
    session.execute(delete(Delivery).where(Delivery.webhook_id == webhook_id))


def deliveries_page(
    session: Session,
    project: str | None,
    webhook_id: int | None,
    alert_id: int | None,
    status: str | None,
    limit: int,
    offset: int,
) -> tuple[Sequence[Delivery], int]:
    """Deliveries (of one project's webhooks if project is given), newest first, and how many match
    before limit/offset."""
    query = select(Delivery)
    if project is not None:
        query = query.join(Webhook, Webhook.id == Delivery.webhook_id).where(Webhook.project == project)
    if webhook_id is not None:
        query = query.where(Delivery.webhook_id == webhook_id)
    if alert_id is not None:
        query = query.where(Delivery.alert_id == alert_id)
    if status is not None:
        query = query.where(Delivery.status == status)
    total = _count(session, query)
    rows = session.scalars(query.order_by(Delivery.id.desc()).limit(limit).offset(offset)).all()
    return rows, total


def claim_delivery(
    session: Session,
    now: float,
    token: str,
    lease_until: float,
    busy_webhooks: Collection[int] = (),
    busy_projects: Collection[str] = (),
) -> Row[int, int, int, str] | None:
    """Atomically take the oldest due delivery (or one whose lease expired at `now`) of a webhook with
    no delivery in flight (in any process: a "sending" row whose lease holds), not of `busy_webhooks`
    nor of a webhook of `busy_projects` (the caller's own limits): it becomes "sending" under `token`
    until `lease_until`, one more attempt. One UPDATE … WHERE id = (SELECT … LIMIT 1 FOR UPDATE SKIP
    LOCKED): two processes never claim the same row. (id, attempts, webhook_id, payload), or None when
    nothing is due."""
    claimable = or_(
        and_(Delivery.status == "pending", Delivery.next_attempt_at <= now),
        and_(Delivery.status == "sending", Delivery.claimed_until < now),
    )
    other = aliased(Delivery)
    in_flight = (
        select(other.id)
        .where(other.webhook_id == Delivery.webhook_id, other.status == "sending", other.claimed_until >= now)
        .exists()
    )
    conditions = [claimable, ~in_flight]
    if busy_webhooks:
        conditions.append(Delivery.webhook_id.notin_(list(busy_webhooks)))
    if busy_projects:
        conditions.append(
            Delivery.webhook_id.notin_(select(Webhook.id).where(Webhook.project.in_(list(busy_projects))))
        )
    oldest = (
        select(Delivery.id)
        .where(*conditions)
        .order_by(Delivery.next_attempt_at, Delivery.id)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return session.execute(
        update(Delivery)
        .where(Delivery.id == oldest, claimable)
        .values(
            status="sending",
            claim_token=token,
            claimed_until=lease_until,
            attempts=Delivery.attempts + 1,
        )
        .returning(Delivery.id, Delivery.attempts, Delivery.webhook_id, Delivery.payload)
        .execution_options(synchronize_session=False)
    ).first()


def finish_delivery(
    session: Session, delivery_id: int, token: str, response_status: int | None, values: dict[str, object]
) -> None:
    """Record an attempt's outcome (`values`: status and what goes with it) if `token` still holds the
    claim; the claim is released."""
    session.execute(
        update(Delivery)
        .where(Delivery.id == delivery_id, Delivery.claim_token == token)
        .values(response_status=response_status, claim_token=None, claimed_until=None, **values)
        .execution_options(synchronize_session=False)
    )


def _count(session: Session, query: Select[Unpack[tuple[Any, ...]]]) -> int:
    return session.scalar(select(func.count()).select_from(query.subquery())) or 0
