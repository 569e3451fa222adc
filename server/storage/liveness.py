"""How runs end: the crash reason an agent reports, and the sweep that marks silent runs crashed.

A run's status is "running" until a batch says "finished" or "crashed" (an exception, a signal: the
agent's `crash` event names it, kept as status_reason), or until none of its ranks has sent anything
for crashed_after_s (a SIGKILLed, OOM-killed or hung job never says so): mark_silent_runs() then
sets it "crashed" with the reason NO_HEARTBEAT. That one is reversible: data arriving again sets
the run back to "running" (Store.ingest), and a run that says it finished ends "finished".

The sweep is one UPDATE guarded by its own WHERE (status still "running", still silent), so any
number of server replicas may run it at the same time: each row changes once, and a batch ingested
concurrently either comes first (the run is no longer silent) or sets the status back after it. On
PostgreSQL the rows are claimed FOR UPDATE SKIP LOCKED: replicas sweeping together never wait for
(or deadlock on) each other's rows, and a run whose row an ingest holds is being written to anyway.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ..models import Run
from ..schemas import BatchIn

NO_HEARTBEAT = "no heartbeat"
CRASH_EVENT = "crash"
MAX_REASON_CHARS = 500


def crash_reason(batch: BatchIn) -> str | None:
    """The reason a crashed rank gives in its `crash` event: "ValueError: message", "SIGTERM"; the
    rank is named for ranks other than 0. None when the batch has no such event (older agents)."""
    event = next((e for e in batch.events if e.kind == CRASH_EVENT), None)
    if event is None:
        return None
    data = event.data
    exception, message, signal = data.get("exception"), data.get("message"), data.get("signal")
    if isinstance(exception, str) and exception:
        reason = f"{exception}: {message}" if isinstance(message, str) and message else exception
    elif isinstance(signal, str) and signal:
        reason = signal
    else:
        return None
    if batch.rank:
        reason = f"rank {batch.rank}: {reason}"
    return reason[:MAX_REASON_CHARS]


def mark_silent_runs(session: Session, now: float, silent_s: float) -> int:
    """Mark every running run whose last data is older than `silent_s` seconds "crashed" (reason
    NO_HEARTBEAT); returns how many changed. Idempotent, safe on several replicas at once."""
    if silent_s <= 0:
        return 0
    silent = (Run.status == "running", Run.updated_at < now - silent_s)
    claimed = select(Run.id).where(*silent).with_for_update(skip_locked=True)
    result = session.execute(
        update(Run)
        .where(Run.id.in_(claimed.scalar_subquery()), *silent)
        .values(status="crashed", status_reason=NO_HEARTBEAT)  # updated_at stays: the last sign of life
        .execution_options(synchronize_session=False)
    )
    return cast("CursorResult[Any]", result).rowcount
