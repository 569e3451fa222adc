"""Attempts kept: no ingest request destroys data (issue 39).

A resume (gradwatch.init(resume=...)) continues a rank from a step; what earlier processes had stored
from that step on leaves the run's default view (the charts show one continuous line) but is not
deleted: it is kept here as an *attempt* of the run, with the resuming process's seq floor. Batches of
the superseded processes that arrive later (a spool replayed, `gradwatch sync`, or a process that is
still running) have their superseded steps kept in the same attempt.

Restart or second writer? A restart's old process is gone: its late batches, if any, come in one burst
(a replay). A process that still sends SECOND_WRITER_AFTER_S after its first late batch is alive and
writing the same rank as the resumed one (two jobs on one run id, or a forged resume): the attempt
records it (second_writer_at), the run gets a `second_writer` event, and every later acknowledgement
of that process says so, so its agent warns its user. Both writers' data is kept.

An attempt is readable by whoever may read the run (GET /runs/{id}/attempts[/{attempt}]) and
restorable by an admin (POST .../restore): the rank's current data from the attempt's step on becomes an
attempt in turn (reason "restore"), the kept data is written back the way ingest writes it, and the
resume that cut it stops cutting that process's later batches.

The data is kept as gzip-compressed batch documents of the ingest wire format (BatchIn), each within
the wire's limits, so a restore is an ingest without its checks.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..models import Event, HistogramPoint, Run, RunAttempt, RunAttemptPart, RunResume, Series, VectorPoint
from ..schemas import BatchIn
from . import chunked_points
from .codecs import iso_time, unpack

__all__ = [
    "SECOND_WRITER_AFTER_S",
    "attempt_documents",
    "attempt_summary",
    "keep_from",
    "keep_late",
    "list_attempts",
    "part_batches",
    "stop_cutting",
]

SECOND_WRITER_AFTER_S = 30.0
SECOND_WRITER_EVENT = "second_writer"
# Sizes of one kept part (each within the wire's limits: schema_fields)
PART_POINTS = 100_000
PART_ROWS = 2_000
PART_EVENTS = 10_000


def _dump(document: dict[str, Any]) -> bytes:
    return gzip.compress(json.dumps(document, allow_nan=True, separators=(",", ":")).encode(), 6)


def _load(data: bytes) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(gzip.decompress(data))
    return loaded


def _documents(
    session: Session, run_id: str, rank: int, step: int
) -> tuple[list[dict[str, Any]], int, int, int | None]:
    """The rank's stored data at `step` and after as batch documents; (documents, points, events, last
    step)."""
    series = session.execute(select(Series.id, Series.key, Series.kind).where(Series.run_id == run_id)).all()
    layers = json.loads(session.scalar(select(Run.layers_json).where(Run.id == run_id)) or "[]")
    documents: list[dict[str, Any]] = []
    points = events = 0
    last: int | None = None

    def seen(steps: list[int]) -> None:
        nonlocal last
        if steps:
            last = max(steps[-1], last if last is not None else steps[-1])

    for series_id, key, kind in series:
        if kind == "scalar":
            found = chunked_points.read(session, series_id, [rank], start=step).get(rank)
            if found is None:
                continue
            for lo in range(0, len(found), PART_POINTS):
                steps = found.steps[lo : lo + PART_POINTS].tolist()
                values = found.values[lo : lo + PART_POINTS].tolist()
                documents.append({"scalars": [{"key": key, "steps": steps, "values": values}]})
                points += len(steps)
                seen(steps)
        elif kind == "vector":
            vector_rows = session.execute(
                select(VectorPoint.step, VectorPoint.data)
                .where(VectorPoint.series_id == series_id, VectorPoint.rank == rank, VectorPoint.step >= step)
                .order_by(VectorPoint.step)
            ).all()
            for lo in range(0, len(vector_rows), PART_ROWS):
                vector_piece = vector_rows[lo : lo + PART_ROWS]
                steps = [int(s) for s, _ in vector_piece]
                vector = {"key": key, "steps": steps, "values": [unpack(d, "d") for _, d in vector_piece]}
                documents.append({"vectors": [vector], "layers": layers})
                points += len(vector_piece)
                seen(steps)
        elif kind == "histogram":
            histogram_rows = session.execute(
                select(
                    HistogramPoint.step,
                    HistogramPoint.exponent_min,
                    HistogramPoint.exponent_max,
                    HistogramPoint.counts,
                )
                .where(
                    HistogramPoint.series_id == series_id,
                    HistogramPoint.rank == rank,
                    HistogramPoint.step >= step,
                )
                .order_by(HistogramPoint.step)
            ).all()
            for lo in range(0, len(histogram_rows), PART_ROWS):
                histograms: list[dict[str, Any]] = []
                histogram_steps: list[int] = []
                for at, low, high, counts in histogram_rows[lo : lo + PART_ROWS]:
                    flat, width = unpack(counts, "q"), high - low + 3  # exponents, zeros, non-finite
                    grid = [flat[i : i + width] for i in range(0, len(flat), width)]
                    histogram_steps.append(int(at))
                    histograms.append(
                        {
                            "key": key,
                            "step": int(at),
                            "exponent_min": low,
                            "exponent_max": high,
                            "counts": grid,
                        }
                    )
                documents.append({"histograms": histograms, "layers": layers})
                points += len(histograms)
                seen(histogram_steps)
    event_rows = session.execute(
        select(Event.step, Event.kind, Event.data_json)
        .where(Event.run_id == run_id, Event.rank == rank, Event.step >= step)
        .order_by(Event.step, Event.id)
    ).all()
    for lo in range(0, len(event_rows), PART_EVENTS):
        event_piece = [
            {"step": int(s), "kind": k, "data": json.loads(d or "{}")}
            for s, k, d in event_rows[lo : lo + PART_EVENTS]
        ]
        documents.append({"events": event_piece})
        events += len(event_piece)
        seen([e["step"] for e in event_piece])
    return documents, points, events, last


def _add_parts(session: Session, attempt_id: int, rank: int, documents: list[dict[str, Any]]) -> None:
    if documents:
        session.execute(
            RunAttemptPart.__table__.insert(),
            [{"attempt_id": attempt_id, "data": _dump({"rank": rank, "seq": 0, **d})} for d in documents],
        )


def keep_from(
    session: Session, run_id: str, rank: int, step: int, reason: str, seq_floor: int | None
) -> int | None:
    """Keep the rank's data at `step` and after as an attempt (before the caller deletes it from the
    default view); its id, or None when there was nothing to keep."""
    documents, points, events, last = _documents(session, run_id, rank, step)
    if not documents:
        return None
    attempt = RunAttempt(
        run_id=run_id,
        rank=rank,
        from_step=step,
        reason=reason,
        seq_floor=seq_floor,
        created_at=time.time(),
        points=points,
        events=events,
        last_step=last,
        late_batches=0,
    )
    session.add(attempt)
    session.flush()
    _add_parts(session, attempt.id, rank, documents)
    return attempt.id


def _cut_part(batch: BatchIn, cutoff: int) -> tuple[dict[str, Any] | None, int, int, int | None]:
    """The part of a superseded process's batch at `cutoff` and after, as a batch document; (document or
    None, points, events, last step)."""
    scalars, vectors, histograms, points = [], [], [], 0
    last: int | None = None
    for series in batch.scalars:
        steps, values = series.steps_array(), series.values_array()
        keep = steps >= cutoff
        if keep.any():
            kept_steps = steps[keep].tolist()
            scalars.append({"key": series.key, "steps": kept_steps, "values": values[keep].tolist()})
            points += len(kept_steps)
            last = max(max(kept_steps), last if last is not None else -1)
    for vector in batch.vectors:
        rows = [(s, v) for s, v in zip(vector.steps, vector.values, strict=True) if s >= cutoff]
        if rows:
            vectors.append({"key": vector.key, "steps": [s for s, _ in rows], "values": [v for _, v in rows]})
            points += len(rows)
            last = max(max(s for s, _ in rows), last if last is not None else -1)
    for histogram in batch.histograms:
        if histogram.step >= cutoff:
            histograms.append(histogram.model_dump())
            points += 1
            last = max(histogram.step, last if last is not None else -1)
    events = [e.model_dump() for e in batch.events if e.step >= cutoff]
    if events:
        last = max(max(e["step"] for e in events), last if last is not None else -1)
    if not (scalars or vectors or histograms or events):
        return None, 0, 0, None
    document: dict[str, Any] = {
        "scalars": scalars,
        "vectors": vectors,
        "histograms": histograms,
        "events": events,
    }
    if batch.layers is not None:
        document["layers"] = batch.layers
    return document, points, len(events), last


def keep_late(
    session: Session, run_id: str, batch: BatchIn, cutoff: int, now: float, second_writer_after_s: float
) -> bool:
    """Keep a superseded process's batch's steps at `cutoff` and after in the attempt its resume made;
    True when that process counts as a second writer (it still sends long after its first late batch),
    in which case the run has a `second_writer` event from the first time it does."""
    document, points, events, last = _cut_part(batch, cutoff)
    attempt = session.scalars(
        select(RunAttempt)
        .where(RunAttempt.run_id == run_id, RunAttempt.rank == batch.rank, RunAttempt.from_step == cutoff)
        .where(RunAttempt.reason == "resume")
        .order_by(RunAttempt.id.desc())
        .limit(1)
    ).first()
    if attempt is None:  # the resume found nothing to keep (the process had stored nothing past it)
        attempt = RunAttempt(
            run_id=run_id,
            rank=batch.rank,
            from_step=cutoff,
            reason="resume",
            seq_floor=None,
            created_at=now,
            points=0,
            events=0,
            last_step=None,
            late_batches=0,
        )
        session.add(attempt)
        session.flush()
    if document is not None:
        _add_parts(session, attempt.id, batch.rank, [document])
        attempt.points += points
        attempt.events += events
        if last is not None:
            attempt.last_step = max(last, attempt.last_step if attempt.last_step is not None else last)
    attempt.late_batches += 1
    attempt.first_late_at = attempt.first_late_at if attempt.first_late_at is not None else now
    attempt.last_late_at = now
    if attempt.second_writer_at is None and now - attempt.first_late_at >= second_writer_after_s:
        attempt.second_writer_at = now
        session.add(
            Event(
                run_id=run_id,
                rank=batch.rank,
                step=cutoff,
                kind=SECOND_WRITER_EVENT,
                data_json=json.dumps(
                    {
                        "attempt": attempt.id,
                        "resumed_at_step": cutoff,
                        "late_batches": attempt.late_batches,
                        "seconds": round(now - attempt.first_late_at, 1),
                        "message": (
                            f"a process resumed rank {batch.rank} at step {cutoff}, but an earlier process "
                            f"still writes it ({attempt.late_batches} batches over "
                            f"{now - attempt.first_late_at:.0f} s): two jobs share this run id. Both are "
                            f"kept: the earlier one's steps from {cutoff} on as attempt {attempt.id}"
                        ),
                    }
                ),
            )
        )
    return attempt.second_writer_at is not None


def attempt_summary(attempt: RunAttempt) -> dict[str, Any]:
    return {
        "id": attempt.id,
        "rank": attempt.rank,
        "from_step": attempt.from_step,
        "last_step": attempt.last_step,
        "reason": attempt.reason,
        "points": attempt.points,
        "events": attempt.events,
        "late_batches": attempt.late_batches,
        "second_writer": attempt.second_writer_at is not None,
        "created_at": iso_time(attempt.created_at),
        "second_writer_at": iso_time(attempt.second_writer_at),
        "restored_at": iso_time(attempt.restored_at),
    }


def list_attempts(session: Session, run_id: str) -> list[dict[str, Any]]:
    rows = session.scalars(select(RunAttempt).where(RunAttempt.run_id == run_id).order_by(RunAttempt.id))
    return [attempt_summary(a) for a in rows]


def _wire(value: Any) -> Any:
    """Non-finite floats as the wire format spells them ("NaN", "Infinity", "-Infinity")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, list):
        return [_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    return value


def attempt_documents(session: Session, run_id: str, attempt_id: int) -> dict[str, Any] | None:
    """An attempt with its data (`batches`: batch documents of the wire format); None if the run has
    no such attempt."""
    attempt = session.get(RunAttempt, attempt_id)
    if attempt is None or attempt.run_id != run_id:
        return None
    return {**attempt_summary(attempt), "batches": [_wire(d) for d in part_batches(session, attempt.id)]}


def part_batches(session: Session, attempt_id: int) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(RunAttemptPart.data).where(RunAttemptPart.attempt_id == attempt_id).order_by(RunAttemptPart.id)
    )
    return [_load(data) for data in rows]


def stop_cutting(session: Session, attempt: RunAttempt) -> None:
    """A restored attempt's process writes the rank again: the resume that cut it cuts it no more."""
    if attempt.seq_floor is not None:
        session.execute(
            delete(RunResume).where(
                RunResume.run_id == attempt.run_id,
                RunResume.rank == attempt.rank,
                RunResume.seq_floor == attempt.seq_floor,
            )
        )
