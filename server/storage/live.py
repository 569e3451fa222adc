"""What is new for a live stream's subscriber, read from the database (gradwatch.server.live wakes the
subscribers; gradwatch.server.routers.live sends what these reads return).

A subscriber keeps a LiveCursor: the last step sent per (key, rank) and the last event sent per rank.
LiveReads.read_new returns what was stored after it and moves it on, so a wake-up that is lost,
repeated or merged with others loses no point and sends none twice; late data of a rank that lags
behind the others is still sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select
from sqlalchemy.orm import Session

from ..database import pin_snapshot
from ..errors import NotFound
from ..models import AgentBatch, Event, PointChunk, Run, Series
from . import chunked_points, queries

__all__ = ["LiveCursor", "LiveEvent", "LiveReads", "LiveUpdate", "PointsChunk"]

MAX_POINTS_PER_READ = 20_000  # more waiting: the subscriber reads again at once
MAX_EVENTS_PER_READ = 2_000
_PAIRS_PER_STATEMENT = 200  # (key, rank) pairs per SQL statement


class LiveReads:
    """Reads for live streams, each in a session of its own that is closed, never committed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def open_cursor(
        self, run_id: str, keys: frozenset[str] | None, rank: int | None, since: int | None
    ) -> LiveCursor:
        """A new subscriber's cursor: after step `since`, or (since None) after what is stored now.
        Raises NotFound for an unknown run."""
        with Session(self.engine) as session:
            pin_snapshot(session)
            return _open_cursor(session, run_id, keys, rank, since)

    def projects_of(self, run_ids: set[str]) -> set[str]:
        """The projects of those of `run_ids` that exist (the runs list's doorbell: whose news it
        may pass on)."""
        ids = sorted(run_ids)
        projects: set[str] = set()
        with Session(self.engine) as session:
            for lo in range(0, len(ids), _PAIRS_PER_STATEMENT):
                chunk = ids[lo : lo + _PAIRS_PER_STATEMENT]
                projects.update(session.scalars(select(Run.project).where(Run.id.in_(chunk)).distinct()))
        return projects

    def read_new(
        self, cursor: LiveCursor, max_points: int = MAX_POINTS_PER_READ, max_events: int = MAX_EVENTS_PER_READ
    ) -> LiveUpdate:
        """What is new for `cursor`, advancing the cursor past it (only once everything was read: a read
        that fails leaves it where it was). Raises NotFound once the run is gone."""
        with Session(self.engine) as session:
            # One snapshot for the read's statements: else a batch committing between two of them
            # comes half (its events without its points, or a status naming steps whose points come
            # only with the next message).
            pin_snapshot(session)
            return _read_new(session, cursor, max_points, max_events)


# -- reading what is new ------------------------------------------------------------------------


@dataclass
class LiveCursor:
    """What one subscriber has been sent. Data is new when its step is after the cursor of its
    (key, rank) (points) or its (step, id) after the cursor of its rank (events); a (key, rank) or a
    rank without a cursor yet starts after `start` (the subscriber's `since`, else -1: from the
    beginning, used for keys and ranks that appear after the subscriber connected)."""

    run_id: str
    keys: frozenset[str] | None  # None: every scalar key, those that appear later included
    rank: int | None  # None: every rank
    start: int
    points: dict[tuple[int, int], int] = field(default_factory=dict)  # (series id, rank) → last step
    events: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank → (step, id) of the last event
    status: tuple[str, int | None] | None = None  # (status, last_step) last sent


@dataclass(frozen=True)
class PointsChunk:
    key: str
    rank: int
    steps: list[int]
    values: list[float]


@dataclass(frozen=True)
class LiveEvent:
    step: int
    kind: str
    rank: int
    data: dict[str, Any]
    id: int


@dataclass(frozen=True)
class LiveUpdate:
    """One read's worth of news; `more` when a read limit was hit and the subscriber should read again."""

    points: list[PointsChunk]
    events: list[LiveEvent]
    status: tuple[str, int | None] | None  # only when it changed since the last update
    more: bool


def _run_status(session: Session, run_id: str) -> tuple[str, int | None]:
    row = session.execute(select(Run.status, Run.last_step).where(Run.id == run_id)).first()
    if row is None:
        raise NotFound(f"run {run_id!r} does not exist")
    return row.status, row.last_step


def _ranks(session: Session, run_id: str) -> list[int]:
    """The ranks that have sent the run a batch: a loose index scan of agent_batches' primary key
    (run_id, rank, seq), one index probe per rank rather than a pass over every batch."""
    first = select(func.min(AgentBatch.rank).label("rank")).where(AgentBatch.run_id == run_id)
    ranks = first.cte("live_ranks", recursive=True)
    following = select(
        select(func.min(AgentBatch.rank))
        .where(AgentBatch.run_id == run_id, AgentBatch.rank > ranks.c.rank)
        .scalar_subquery()
    ).where(ranks.c.rank.is_not(None))
    ranks = ranks.union_all(following)
    return list(session.scalars(select(ranks.c.rank).where(ranks.c.rank.is_not(None))))


def _series_and_ranks(session: Session, cursor: LiveCursor) -> tuple[dict[int, str], list[int]]:
    """The subscriber's scalar series (id → key) and ranks (those that have sent a batch)."""
    query = select(Series.id, Series.key).where(Series.run_id == cursor.run_id, Series.kind == "scalar")
    if cursor.keys is not None:
        query = query.where(Series.key.in_(sorted(cursor.keys)))
    series = {series_id: key for series_id, key in session.execute(query)}
    ranks = _ranks(session, cursor.run_id)
    if cursor.rank is not None:
        ranks = [rank for rank in ranks if rank == cursor.rank]
    return series, ranks


def _open_cursor(
    session: Session, run_id: str, keys: frozenset[str] | None, rank: int | None, since: int | None
) -> LiveCursor:
    """A new subscriber's cursor: after step `since`, or (since None) after what is stored now.
    Raises NotFound for an unknown run."""
    status = _run_status(session, run_id)
    cursor = LiveCursor(run_id, keys, rank, start=-1 if since is None else since, status=status)
    if since is not None:
        return cursor
    series, ranks = _series_and_ranks(session, cursor)
    pairs = [(series_id, rank) for series_id in sorted(series) for rank in ranks]
    for chunk in queries.chunks(
        pairs, _PAIRS_PER_STATEMENT
    ):  # the newest step of each pair: one index probe each
        newest = session.execute(
            select(
                *(
                    select(func.max(PointChunk.last_step))
                    .where(PointChunk.series_id == series_id, PointChunk.rank == rank)
                    .scalar_subquery()
                    for series_id, rank in chunk
                )
            )
        ).one()
        cursor.points.update(
            {pair: step for pair, step in zip(chunk, newest, strict=True) if step is not None}
        )
    newest_events = (
        select(Event.rank, func.max(Event.step).label("step"))
        .where(Event.run_id == run_id)
        .group_by(Event.rank)
    )
    if rank is not None:
        newest_events = newest_events.where(Event.rank == rank)
    newest_event = newest_events.subquery()
    rows = session.execute(
        select(Event.rank, Event.step, func.max(Event.id))
        .join(newest_event, and_(Event.rank == newest_event.c.rank, Event.step == newest_event.c.step))
        .where(Event.run_id == run_id)
        .group_by(Event.rank, Event.step)
    )
    cursor.events.update({rank: (step, event_id) for rank, step, event_id in rows})
    return cursor


def _read_new(
    session: Session,
    cursor: LiveCursor,
    max_points: int = MAX_POINTS_PER_READ,
    max_events: int = MAX_EVENTS_PER_READ,
) -> LiveUpdate:
    """What is new for `cursor`, advancing the cursor past it (only once everything was read: a read
    that fails leaves it where it was). Raises NotFound once the run is gone."""
    # The status first: it then never names a step whose points this read has not seen, even in a
    # session that is not one snapshot (read_new's are).
    status = _run_status(session, cursor.run_id)
    series, ranks = _series_and_ranks(session, cursor)
    points, last_steps, more = _new_points(session, cursor, series, ranks, max_points)
    events, more_events = _new_events(session, cursor, ranks, max_events)
    changed = status != cursor.status
    cursor.points.update(last_steps)
    cursor.events.update({event.rank: (event.step, event.id) for event in events})
    cursor.status = status
    return LiveUpdate(points, events, status if changed else None, more or more_events)


def _new_points(
    session: Session, cursor: LiveCursor, series: dict[int, str], ranks: list[int], limit: int
) -> tuple[list[PointsChunk], dict[tuple[int, int], int], bool]:
    """Points after the cursor of their (key, rank), at most `limit` (then True: more are waiting),
    and the steps the cursor moves to: chunks ending after each pair's cursor, a few hundred pairs
    per statement (chunked_points.read_after)."""
    afters = {
        (series_id, rank): cursor.points.get((series_id, rank), cursor.start)
        for series_id in sorted(series)
        for rank in ranks
    }
    found, more = chunked_points.read_after(session, afters, limit)
    chunks = [
        PointsChunk(series[series_id], rank, points.steps.tolist(), points.values.tolist())
        for (series_id, rank), points in sorted(found.items())
    ]
    last_steps = {pair: int(points.steps[-1]) for pair, points in found.items()}
    return chunks, last_steps, more


def _new_events(
    session: Session, cursor: LiveCursor, ranks: list[int], limit: int
) -> tuple[list[LiveEvent], bool]:
    """Events after the cursor of their rank, in (step, id) order, at most `limit` (then True).
    A rank's batches are stored one after another, so of two events of a rank at one step the later
    has the larger id. The scan of the run's (run_id, step) index starts at the lowest cursor of the
    ranks known to have sent batches (a rank that has sent no event yet starts at `start`)."""
    if not ranks:
        return [], False  # no batch, no event (a rank's first batch is read next time)
    floor = min(cursor.events[rank][0] if rank in cursor.events else cursor.start + 1 for rank in ranks)
    seen = [
        and_(Event.rank == rank, or_(Event.step > step, and_(Event.step == step, Event.id > event_id)))
        for rank, (step, event_id) in cursor.events.items()
    ]
    unseen = Event.step > cursor.start
    if cursor.events:
        unseen = and_(Event.rank.not_in(list(cursor.events)), unseen)
    query = select(Event.id, Event.rank, Event.step, Event.kind, Event.data_json).where(
        Event.run_id == cursor.run_id, Event.step >= floor, or_(unseen, *seen)
    )
    if cursor.rank is not None:
        query = query.where(Event.rank == cursor.rank)
    rows = session.execute(query.order_by(Event.step, Event.id).limit(limit + 1)).all()
    events = [
        LiveEvent(row.step, row.kind, row.rank, json.loads(row.data_json), row.id) for row in rows[:limit]
    ]
    return events, len(rows) > limit
