"""Reading a run's events from a cursor: a page that polls asks only for the events stored after the
last one it has (GET /api/v1/runs/{id}/events?after_id=N).

Event ids grow in the order events are stored, so "after id N" is "stored after the event N", with
two exceptions the count reveals: a resume deletes the newest events and SQLite may give the next
event one of their ids again, and on PostgreSQL a concurrent ingest may commit an event with a lower
id after a later one was read. `EventPage.count` counts every event the filters match, the cursor
aside: a reader that holds `held` events and receives `new` has them all when held + new == count;
anything else means it should read in full once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from ..models import Event
from . import queries
from .store import EventRecord

__all__ = ["EventPage", "EventReads"]


@dataclass(frozen=True)
class EventPage:
    """Events, how many the filters match in all (the cursor aside), and the cursor to read on from:
    the largest id the page holds when it holds everything up to it (None when it cannot say)."""

    events: list[EventRecord]
    count: int
    last_id: int | None


class EventReads:
    """Reads of a run's events, each in a session of its own that is closed, never committed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def page(
        self,
        run_id: str,
        kind: str | None,
        start: int | None,
        end: int | None,
        limit: int,
        after_id: int | None = None,
    ) -> EventPage:
        """Events of kind `kind` (None: any) at steps start <= step < end, at most `limit`.

        after_id None: the first ones in step order; last_id is the largest id among them when they
        are all there are, None when `limit` cut the list. after_id N: those stored after the event
        with id N, in the order they were stored; last_id is the largest id returned (N when none).
        Raises NotFound for an unknown run.
        """
        with Session(self.engine) as session:
            queries.require_run(session, run_id)
            query = select(Event).where(Event.run_id == run_id)
            if kind is not None:
                query = query.where(Event.kind == kind)
            query = queries.step_range(query, Event.step, start, end)
            count = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            if after_id is None:
                rows = session.scalars(query.order_by(Event.step, Event.id).limit(limit)).all()
                complete = len(rows) == count
                last_id = max((row.id for row in rows), default=0) if complete else None
            else:
                query = query.where(Event.id > after_id).order_by(Event.id).limit(limit)
                rows = session.scalars(query).all()
                last_id = max((row.id for row in rows), default=after_id)
            events = [EventRecord(row.step, row.kind, row.rank, json.loads(row.data_json)) for row in rows]
            return EventPage(events, count, last_id)
