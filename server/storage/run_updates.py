"""Ingest's UPDATE of a run's row after a batch: its status and status_reason, updated_at, layers
and last_step, as one plain-SQL statement.

The status is computed from the row as it stands when the UPDATE runs (a crash an agent reported
stays, a run marked crashed for silence runs again on any data, a resume starts a new attempt), so
replicas and the liveness sweep may interleave with ingest freely; gradwatch.server.storage.store
calls _status_sql and _update_run inside the batch's transaction.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from ..models import Run
from ..schemas import BatchIn
from . import bulk, liveness

# A crash the agent reported (not the server's NO_HEARTBEAT mark), as SQL on the row being updated.
_REPORTED_CRASH = "status = 'crashed' AND COALESCE(status_reason, '') <> ?"


def _status_sql(batch: BatchIn, resumed: bool) -> tuple[str, list[Any]]:
    """The run's status and status_reason after `batch`: the SET clause's part of ingest's UPDATE runs
    (? placeholders) and its parameters.

    Computed from the row as it is when the UPDATE runs, so replicas and the liveness sweep may
    interleave freely. A crash the agent reported stays: in a distributed run one rank's crash is not
    overwritten by another rank finishing, and the first crash's reason is kept. A run the server
    marked crashed for silence (NO_HEARTBEAT) was not dead: any data sets it running again, and it can
    end finished. A resume starts a new attempt: how the previous one ended no longer counts.
    (Plain SQL: built as SQLAlchemy CASE expressions, compiled and synchronised with the session,
    this UPDATE cost about a millisecond of every batch.)"""
    reason = liveness.crash_reason(batch) if batch.status == "crashed" else None
    if resumed:
        return "status = ?, status_reason = ?", [batch.status or "running", reason]
    if batch.status == "finished":
        return (
            (
                f"status = CASE WHEN {_REPORTED_CRASH} THEN 'crashed' ELSE 'finished' END,"
                f" status_reason = CASE WHEN {_REPORTED_CRASH} THEN status_reason ELSE NULL END"
            ),
            [liveness.NO_HEARTBEAT, liveness.NO_HEARTBEAT],
        )
    if batch.status == "crashed":
        return (
            f"status = 'crashed', status_reason = CASE WHEN {_REPORTED_CRASH} THEN status_reason ELSE ? END",
            [liveness.NO_HEARTBEAT, reason],
        )
    if batch.status is not None:
        return "status = ?, status_reason = NULL", [batch.status]
    silent = "status = 'crashed' AND status_reason = ?"
    return (
        (
            f"status = CASE WHEN {silent} THEN 'running' ELSE status END,"
            f" status_reason = CASE WHEN {silent} THEN NULL ELSE status_reason END"
        ),
        [liveness.NO_HEARTBEAT, liveness.NO_HEARTBEAT],
    )


def _update_run(
    session: Session,
    run: Run,
    now: float,
    layers: list[str] | None,
    last_step: tuple[str, int | None] | None,
    status: tuple[str, list[Any]] | None,
) -> None:
    """UPDATE the run's row after a batch (updated_at = now; layers_json when `layers`; last_step as
    ("set", step) or ("raise", step): at least that step; status as _status_sql gives it), as plain
    SQL, and give the session's Run object the stored values (RETURNING) as the ORM's UPDATE did."""
    sets: list[str] = ["updated_at = ?"]
    params: list[Any] = [now]
    if layers is not None:
        sets.append("layers_json = ?")
        params.append(json.dumps(layers))
    if last_step is not None:
        how, step = last_step
        if how == "set":
            sets.append("last_step = ?")
        else:  # SQLite spells the two-argument maximum max(); PostgreSQL spells it greatest().
            maximum = "max" if session.get_bind().dialect.name == "sqlite" else "greatest"
            sets.append(f"last_step = {maximum}(COALESCE(last_step, -1), ?)")
        params.append(step)
    if status is not None:
        sets.append(status[0])
        params += status[1]
    if session.new or session.dirty or session.deleted:
        session.flush()  # what the ORM's UPDATE would have flushed first
    stored = bulk.execute(
        session,
        f"UPDATE runs SET {', '.join(sets)} WHERE id = ? RETURNING status, status_reason, last_step,"
        " updated_at, layers_json",
        [*params, run.id],
    )
    if stored:
        for name, stored_value in zip(
            ("status", "status_reason", "last_step", "updated_at", "layers_json"), stored[0], strict=True
        ):
            set_committed_value(run, name, stored_value)
