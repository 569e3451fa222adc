"""Query helpers shared by the store, its read models and the alert engine; each runs in the caller's
session (and so in its transaction)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import InvalidRequest, NotFound
from ..models import Event, Run, Series

__all__ = ["IN_CHUNK", "chunks", "events_of_kinds", "require_run", "series_id", "step_range"]

IN_CHUNK = 500  # IN-lists are sent in chunks of this many values

T = TypeVar("T")


def require_run(session: Session, run_id: str, lock: bool = False, for_update: bool = False) -> Run:
    """The run, or NotFound. lock: hold a KEY SHARE lock on its row until commit (PostgreSQL;
    ingest), so delete_run cannot remove the run's series under a batch being written. for_update:
    an exclusive row lock instead (a resume, which rewrites the run's data)."""
    locking: Any = True if for_update else {"key_share": True} if lock else None
    run = session.get(Run, run_id, with_for_update=locking)
    if run is None:
        raise NotFound(f"run {run_id!r} does not exist")
    return run


def series_id(session: Session, run_id: str, key: str, kind: str | None = None) -> int | None:
    """The id of the run's series `key`, None if the run has none. With `kind` ("scalar", "vector",
    "histogram"), InvalidRequest when the key holds another kind of data."""
    row = session.execute(
        select(Series.id, Series.kind).where(Series.run_id == run_id, Series.key == key)
    ).first()
    if row is None:
        return None
    found, stored_kind = row
    if kind is not None and stored_kind != kind:
        raise InvalidRequest(f"key {key!r} holds {stored_kind} data, not {kind} data")
    return found


def step_range(query: Any, column: Any, start: int | None, end: int | None) -> Any:
    """The query limited to start <= column < end (either bound may be None: open)."""
    if start is not None:
        query = query.where(column >= start)
    if end is not None:
        query = query.where(column < end)
    return query


def chunks(items: list[T], size: int = IN_CHUNK) -> Iterator[list[T]]:
    """Consecutive pieces of at most `size` items (IN-lists, bound parameters per statement)."""
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def events_of_kinds(session: Session, run_id: str, kinds: Iterable[str], limit: int) -> list[tuple[str, Any]]:
    """(kind, data) of the run's first `limit` events of these kinds, in step order."""
    rows = session.execute(
        select(Event.kind, Event.data_json)
        .where(Event.run_id == run_id, Event.kind.in_(tuple(kinds)))
        .order_by(Event.step, Event.id)
        .limit(limit)
    )
    return [(kind, json.loads(data_json)) for kind, data_json in rows]
