"""Resumed runs: a process that continues a run from a checkpoint supersedes what earlier processes
recorded from its resume step on (Store.ingest calls these in the batch's transaction).

The agent of a resumed run (gradwatch.init(resume=...)) sends one `resume` event, at the step it
continues from, in its first batch. From that step on the rank's stored data is replaced in the default
view: points, per-layer vectors, histograms and events at or after it are kept as an attempt of the run
(storage.attempts: readable, restorable by an admin, never deleted by an ingest) and removed from the
run's tables (the rollups holding them recomputed) before the batch is written, so the charts show one
continuous line: the first attempt up to the resume step, the resumed one after it. The event is
stored with what it replaced: previous_last_step (the rank's last stored step, None when there was
nothing), previous_status and previous_status_reason (how the run stood before).

Order does not matter: each resume is recorded in run_resumes with the seq floor of the resuming
process (a sender's seqs are (its start time in ms << 20) + a counter, so every batch of an earlier
process has a lower seq), and a batch of an earlier process that arrives later (a spool replayed by
the resumed run, `gradwatch sync`) is cut to the steps before the resume (the rest kept in the attempt,
and a process still sending long after is told apart as a second writer) and cannot change the run's
status; the resume event of such a process (a resume that a later resume superseded) is recorded but
deletes nothing. Agents with other seq schemes lose only these last guarantees.

What a leaked ingest token can do is bounded: a resume whose seq lies in the future (beyond
MAX_CLOCK_SKEW_S) is refused, so it cannot cut the run's later processes; a resume that would replace
steps of a run that finished (runs.finished_step) needs an admin token; and a batch cut by a resume
says so in its acknowledgement (superseded_from), so the agent whose data is cut warns its user.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ..errors import Conflict, InvalidRequest
from ..models import (
    Event,
    HistogramPoint,
    PointRollup,
    Run,
    RunResume,
    Series,
    VectorPoint,
    VectorRollup,
)
from ..schemas import BatchIn, EventIn
from . import attempts, bulk, chunked_points, rollups

RESUME_EVENT = "resume"
SEQ_COUNTER_BITS = 20  # the agent's seq layout: (namespace << 20) | counter (gradwatch._sender)
# How far ahead of the server's clock a resuming process may have started (its clock's skew). A resume
# supersedes every process whose seqs lie below its own, so one from further ahead would silence the
# run's processes for that long (a seq of 2^63 - 1: for ever).
MAX_CLOCK_SKEW_S = 3600.0


def seq_floor(seq: int) -> int:
    """The lowest seq of the sender namespace `seq` belongs to: every earlier process's seqs are lower."""
    return (seq >> SEQ_COUNTER_BITS) << SEQ_COUNTER_BITS


def resume_event(batch: BatchIn) -> EventIn | None:
    """The batch's `resume` event (the earliest, should there be several), or None."""
    resumes = [event for event in batch.events if event.kind == RESUME_EVENT]
    return min(resumes, key=lambda event: event.step) if resumes else None


def check_resume_seq(seq: int, now: float) -> None:
    """Refuse a resume whose seq says its process started later than the server's clock allows."""
    started_ms = seq >> SEQ_COUNTER_BITS
    if started_ms > (now + MAX_CLOCK_SKEW_S) * 1000:
        raise InvalidRequest(
            f"a resume's seq ({seq}) says its process started at {started_ms} ms since the epoch, more "
            f"than {MAX_CLOCK_SKEW_S:.0f} s after the server's clock ({now * 1000:.0f} ms): seqs of the "
            "agent's layout are (the sender's start in ms << 20) + a counter; check the clocks"
        )


def check_history(run: Run, step: int, may_rewrite_history: bool) -> None:
    """Refuse a resume that would replace steps of a run that finished, unless the caller may rewrite
    history (an admin token, or a server without tokens): what every training job holds (an ingest
    token) must not be able to erase a finished run."""
    finished = run.finished_step
    if finished is None or step > finished or may_rewrite_history:
        return
    raise Conflict(
        f"run {run.id!r} finished at step {finished}; a resume at step {step} would replace its "
        "history, which needs a token with admin scope: continue it from a later step, start a new "
        "run, or resume it with an admin token"
    )


def superseding_step(session: Session, run_id: str, rank: int, seq: int) -> int | None:
    """The step from which a later process took over the data of the process that sent `seq`: the
    earliest resume of this rank by a process that started after it; None when there is none."""
    found = bulk.execute(  # every batch asks: plain SQL, no ORM
        session,
        "SELECT min(step) FROM run_resumes WHERE run_id = ? AND rank = ? AND seq_floor > ?",
        [run_id, rank, seq],
    )
    return None if found[0][0] is None else int(found[0][0])


def clip(batch: BatchIn, cutoff: int) -> BatchIn:
    """The batch of a superseded process, cut to its steps before `cutoff`, without a status."""
    scalars = []
    for series in batch.scalars:
        kept = [(s, v) for s, v in zip(series.steps, series.values, strict=True) if s < cutoff]
        if kept:
            scalars.append(
                series.model_copy(update={"steps": [s for s, _ in kept], "values": [v for _, v in kept]})
            )
    vectors = []
    for vector in batch.vectors:
        rows = [(s, row) for s, row in zip(vector.steps, vector.values, strict=True) if s < cutoff]
        if rows:
            vectors.append(
                vector.model_copy(update={"steps": [s for s, _ in rows], "values": [r for _, r in rows]})
            )
    return batch.model_copy(
        update={
            "scalars": scalars,
            "vectors": vectors,
            "histograms": [h for h in batch.histograms if h.step < cutoff],
            "events": [e for e in batch.events if e.step < cutoff],
            "status": None,
        }
    )


# Points are chunked (storage.chunked_points); the per-step tables are read and cut here directly.
_MODELS: dict[str, Any] = {"vector": VectorPoint, "histogram": HistogramPoint}


def _previous_last_step(session: Session, run_id: str, rank: int, ids: dict[str, list[int]]) -> int | None:
    """The rank's last stored step over its data and events: one backward index seek per series (a
    max over an IN list would read every point of the run)."""
    steps = [
        session.scalar(select(func.max(model.step)).where(model.series_id == series_id, model.rank == rank))
        for kind, model in _MODELS.items()
        for series_id in ids[kind]
    ]
    steps.extend(chunked_points.last_step(session, series_id, rank) for series_id in ids["scalar"])
    steps.append(
        session.scalar(select(func.max(Event.step)).where(Event.run_id == run_id, Event.rank == rank))
    )
    found = [step for step in steps if step is not None]
    return max(found) if found else None


def supersede(
    session: Session, run_id: str, rank: int, step: int, seq_floor: int | None, reason: str = "resume"
) -> int | None:
    """Take the rank's data at `step` and after (points, vectors, histograms, events) out of the default
    view, kept as an attempt of the run (storage.attempts: `reason`, taken over by the process of
    `seq_floor`), and bring the rollups in line; returns the rank's last stored step before (None:
    nothing was stored)."""
    rows = session.execute(select(Series.id, Series.kind).where(Series.run_id == run_id)).all()
    ids: dict[str, list[int]] = {kind: [] for kind in ("scalar", *_MODELS)}
    for series_id, kind in rows:
        ids.setdefault(kind, []).append(series_id)
    previous = _previous_last_step(session, run_id, rank, ids)
    if previous is None or previous < step:
        return previous  # a continuation: nothing to replace
    attempts.keep_from(session, run_id, rank, step, reason, seq_floor)
    chunked_points.delete_from(session, ids["scalar"], rank, step)
    for kind, model in _MODELS.items():
        if ids[kind]:
            session.execute(
                delete(model).where(model.series_id.in_(ids[kind]), model.rank == rank, model.step >= step)
            )
    session.execute(delete(Event).where(Event.run_id == run_id, Event.rank == rank, Event.step >= step))
    # Every bucket holding `step` or a later one goes; the partly kept bucket holding step - 1 is then
    # recomputed from what is left below it, level by level.
    for table, kind in ((PointRollup, "scalar"), (VectorRollup, "vector")):
        if not ids[kind]:
            continue
        for level in range(1, rollups.LEVELS + 1):
            session.execute(
                delete(table).where(
                    table.series_id.in_(ids[kind]),
                    table.rank == rank,
                    table.level == level,
                    table.bucket >= step // rollups.width(level),
                )
            )
    if step > 0:
        if ids["scalar"]:
            rollups.refresh_points(session, rank, {sid: [step - 1] for sid in ids["scalar"]})
        if ids["vector"]:
            rollups.refresh_vectors(session, rank, {sid: [step - 1] for sid in ids["vector"]})
    return previous


def record(session: Session, insert: Any, run_id: str, rank: int, seq: int, step: int) -> None:
    """Remember that the process that sent `seq` resumed the rank at `step` (once per process)."""
    session.execute(
        insert(RunResume)
        .values(run_id=run_id, rank=rank, seq_floor=seq_floor(seq), step=step, created_at=time.time())
        .on_conflict_do_nothing()
    )


def with_resume_facts(batch: BatchIn, event: EventIn, facts: dict[str, Any]) -> BatchIn:
    """The batch with `facts` (what the resume replaced) added to its resume event's data."""
    enriched = event.model_copy(update={"data": {**event.data, **facts}})
    return batch.model_copy(update={"events": [enriched if e is event else e for e in batch.events]})


def without(batch: BatchIn, event: EventIn) -> BatchIn:
    """The batch without `event`."""
    return batch.model_copy(update={"events": [e for e in batch.events if e is not event]})
