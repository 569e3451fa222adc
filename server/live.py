"""Live streams: a run's new points, events and status pushed to WebSocket subscribers within a second
of ingest, on one server process or many.

    ingest (a threadpool thread)                                      the event loop
    Store.after_commit → LiveHub.after_commit ─ SQLite ─ call_soon_threadsafe → wake the run's subscribers
                                              └ PostgreSQL: PostgresRelay.publish
                                                → NOTIFY gradwatch_live, '<run_id>'
    every server process: PostgresRelay's LISTEN thread ─ call_soon_threadsafe → wake …

A wake-up carries no data, only a run id: each subscriber then reads what is new for it from the
database (read_new, in a worker thread) from its own cursor, the last step sent per (key, rank) and
the last event sent per rank. So a notification may be lost, repeated or merged with others without a
point being lost or sent twice; late data of a rank that lags behind the others is still sent; nothing
depends on how much a batch held. A subscriber whose read is in flight is only marked dirty (no queue
grows, however slow its client), and every subscriber reads every refresh_interval_s anyway, so a
NOTIFY missed while the listener reconnects delays data instead of losing it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import Engine, and_, func, or_, select, text
from sqlalchemy.orm import Session

from .errors import NotFound
from .models import AgentBatch, Event, Point, Run, Series
from .schemas import BatchIn, json_float
from .store import decode_float

__all__ = [
    "CHANNEL",
    "LiveCursor",
    "LiveEvent",
    "LiveHub",
    "LiveUpdate",
    "PointsChunk",
    "PostgresRelay",
    "open_cursor",
    "read_new",
    "status_message",
]

logger = logging.getLogger("gradwatch.live")

CHANNEL = "gradwatch_live"  # the PostgreSQL notification channel; the payload is a run id
REFRESH_INTERVAL_S = 5.0  # every subscriber reads at least this often, notified or not
MIN_READ_INTERVAL_S = 0.05  # a subscriber reads at most this often (wake-ups in between are merged)
MAX_CONCURRENT_READS = 4  # live reads in worker threads at once per process (ingest keeps the rest)
MAX_POINTS_PER_READ = 20_000  # more waiting: the subscriber reads again at once
MAX_EVENTS_PER_READ = 2_000
_PAIRS_PER_STATEMENT = 200  # (key, rank) pairs per SQL statement

T = TypeVar("T")


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

    def messages(self, max_points: int = 5_000, max_events: int = 500) -> Iterator[dict[str, Any]]:
        """The update as protocol messages (see gradwatch.server.routers.live): points per (key, rank)
        in pieces of at most max_points, events in pieces of at most max_events, the status last."""
        for chunk in self.points:
            for lo in range(0, len(chunk.steps), max_points):
                yield {
                    "type": "points",
                    "key": chunk.key,
                    "rank": chunk.rank,
                    "steps": chunk.steps[lo : lo + max_points],
                    "values": [json_float(v) for v in chunk.values[lo : lo + max_points]],
                }
        for lo in range(0, len(self.events), max_events):
            yield {
                "type": "events",
                "data": [
                    {"step": e.step, "kind": e.kind, "rank": e.rank, "data": e.data}
                    for e in self.events[lo : lo + max_events]
                ],
            }
        if self.status is not None:
            yield status_message(self.status)


def status_message(status: tuple[str, int | None]) -> dict[str, Any]:
    return {"type": "status", "status": status[0], "last_step": status[1]}


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


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def _statements(conditions: list[tuple[int, Any]]) -> Iterator[list[Any]]:
    """(pairs covered, condition)s in groups covering about _PAIRS_PER_STATEMENT (key, rank) pairs
    each: a statement's bound parameters stay far below SQLite's limit however many ranks a run has."""
    group: list[Any] = []
    pairs = 0
    for size, condition in conditions:
        if group and pairs + size > _PAIRS_PER_STATEMENT:
            yield group
            group, pairs = [], 0
        group.append(condition)
        pairs += size
    if group:
        yield group


def open_cursor(
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
    for chunk in _chunks(pairs, _PAIRS_PER_STATEMENT):  # the newest step of each pair: one index probe each
        newest = session.execute(select(*(
            select(func.max(Point.step))
            .where(Point.series_id == series_id, Point.rank == rank)
            .scalar_subquery()
            for series_id, rank in chunk
        ))).one()
        cursor.points.update({pair: step for pair, step in zip(chunk, newest) if step is not None})
    newest_event = (
        select(Event.rank, func.max(Event.step).label("step"))
        .where(Event.run_id == run_id)
        .group_by(Event.rank)
    )
    if rank is not None:
        newest_event = newest_event.where(Event.rank == rank)
    newest_event = newest_event.subquery()
    rows = session.execute(
        select(Event.rank, Event.step, func.max(Event.id))
        .join(newest_event, and_(Event.rank == newest_event.c.rank, Event.step == newest_event.c.step))
        .where(Event.run_id == run_id)
        .group_by(Event.rank, Event.step)
    )
    cursor.events.update({rank: (step, event_id) for rank, step, event_id in rows})
    return cursor


def read_new(
    session: Session,
    cursor: LiveCursor,
    max_points: int = MAX_POINTS_PER_READ,
    max_events: int = MAX_EVENTS_PER_READ,
) -> LiveUpdate:
    """What is new for `cursor`, advancing the cursor past it (only once everything was read: a read
    that fails leaves it where it was). Raises NotFound once the run is gone."""
    series, ranks = _series_and_ranks(session, cursor)
    points, last_steps, more = _new_points(session, cursor, series, ranks, max_points)
    events, more_events = _new_events(session, cursor, ranks, max_events)
    status = _run_status(session, cursor.run_id)  # last: the status covers at least the data above
    changed = status != cursor.status
    cursor.points.update(last_steps)
    cursor.events.update({event.rank: (event.step, event.id) for event in events})
    cursor.status = status
    return LiveUpdate(points, events, status if changed else None, more or more_events)


def _new_points(
    session: Session, cursor: LiveCursor, series: dict[int, str], ranks: list[int], limit: int
) -> tuple[list[PointsChunk], dict[tuple[int, int], int], bool]:
    """Points after the cursor of their (key, rank), at most `limit` (then True: more are waiting),
    and the steps the cursor moves to. Usually one statement: range probes of the primary key
    (series_id, rank, step), OR-ed, unordered (an ORDER BY would make SQLite walk the whole index).
    A backlog of more than `limit` points is then read pair by pair, each in step order."""
    afters = {
        (series_id, rank): cursor.points.get((series_id, rank), cursor.start)
        for series_id in sorted(series)
        for rank in ranks
    }
    # Pairs with the same key and cursor share one condition (every rank of a key usually does).
    ranks_after: dict[tuple[int, int], list[int]] = {}
    for (series_id, rank), after in afters.items():
        ranks_after.setdefault((series_id, after), []).append(rank)
    conditions = [  # (pairs covered, condition)
        (len(some_ranks), and_(Point.series_id == series_id, Point.rank.in_(some_ranks), Point.step > after))
        for (series_id, after), group in ranks_after.items()
        for some_ranks in _chunks(group, _PAIRS_PER_STATEMENT)
    ]
    columns = (Point.series_id, Point.rank, Point.step, Point.value, Point.flag)
    rows: list[Any] = []
    for chunk in _statements(conditions):
        rows.extend(session.execute(select(*columns).where(or_(*chunk)).limit(limit + 1 - len(rows))).all())
        if len(rows) > limit:
            break
    more = len(rows) > limit
    if more:
        rows = []
        for (series_id, rank), after in afters.items():
            if len(rows) >= limit:
                break
            rows.extend(session.execute(
                select(*columns)
                .where(Point.series_id == series_id, Point.rank == rank, Point.step > after)
                .order_by(Point.step)
                .limit(limit - len(rows))
            ).all())
    rows.sort(key=lambda row: (row.series_id, row.rank, row.step))
    chunks: list[PointsChunk] = []
    last_steps: dict[tuple[int, int], int] = {}
    for row in rows:
        if not chunks or chunks[-1].key != series[row.series_id] or chunks[-1].rank != row.rank:
            chunks.append(PointsChunk(series[row.series_id], row.rank, [], []))
        chunks[-1].steps.append(row.step)
        chunks[-1].values.append(decode_float(row.value, row.flag))
        last_steps[(row.series_id, row.rank)] = row.step
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


# -- the hub: subscribers per run on the event loop ------------------------------------------------


class LiveHub:
    """Subscribers per run on the server's event loop, woken by notify(run_id). The store hook
    (after_commit) may be called from any thread; on PostgreSQL it goes through a PostgresRelay so
    that every server process's subscribers are woken. start() in the app's lifespan, stop() after."""

    def __init__(
        self,
        engine: Engine,
        *,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        min_read_interval_s: float = MIN_READ_INTERVAL_S,
        max_concurrent_reads: int = MAX_CONCURRENT_READS,
        relay: PostgresRelay | None = None,
    ) -> None:
        if refresh_interval_s <= 0 or min_read_interval_s < 0 or max_concurrent_reads < 1:
            raise ValueError(
                f"refresh_interval_s={refresh_interval_s}, min_read_interval_s={min_read_interval_s} and "
                f"max_concurrent_reads={max_concurrent_reads}: need > 0, >= 0 and >= 1"
            )
        self.engine = engine
        self.refresh_interval_s = refresh_interval_s
        self.min_read_interval_s = min_read_interval_s
        self._max_concurrent_reads = max_concurrent_reads
        if relay is None and engine.dialect.name == "postgresql":
            relay = PostgresRelay(engine, self.notify_threadsafe, self.notify_all_threadsafe)
        self.relay = relay
        self._subscribers: dict[str, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # -- lifecycle (on the event loop) ------------------------------------------------------------

    def start(self) -> LiveHub:
        """Bind to the running event loop and start the relay (if any). Call from async code."""
        self._bind()
        if self.relay is not None:
            self.relay.start()
        return self

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        self._loop = None

    def _bind(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._limiter = anyio.CapacityLimiter(self._max_concurrent_reads)

    # -- wake-ups ---------------------------------------------------------------------------------

    def after_commit(self, run_id: str, _batch: BatchIn) -> None:
        """Store.after_commit hook: quick, never raises (the batch is already stored)."""
        try:
            if self.relay is not None:
                self.relay.publish(run_id)
            else:
                self.notify_threadsafe(run_id)
        except Exception:  # a live view is not worth failing an ingest for
            logger.exception("gradwatch: could not notify live subscribers of run %r", run_id)

    def notify_threadsafe(self, run_id: str) -> None:
        """Wake the run's subscribers, from any thread; a no-op before start() or after stop()."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.notify, run_id)
            except RuntimeError:  # the loop has closed: nobody is subscribed any more
                pass

    def notify_all_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.notify_all)
            except RuntimeError:
                pass

    def notify(self, run_id: str) -> None:
        """Wake the run's subscribers (on the event loop)."""
        for wake in self._subscribers.get(run_id, ()):
            wake.set()

    def notify_all(self) -> None:
        for wakes in self._subscribers.values():
            for wake in wakes:
                wake.set()

    # -- subscribers ------------------------------------------------------------------------------

    @contextmanager
    def subscribe(self, run_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever the run may have news, registered until the block ends."""
        self._bind()
        wake = asyncio.Event()
        self._subscribers.setdefault(run_id, set()).add(wake)
        try:
            yield wake
        finally:
            wakes = self._subscribers.get(run_id)
            if wakes is not None:
                wakes.discard(wake)
                if not wakes:
                    del self._subscribers[run_id]

    def subscriber_count(self, run_id: str | None = None) -> int:
        """Open subscriptions (of one run); safe to call from any thread."""
        if run_id is not None:
            return len(self._subscribers.get(run_id, ()))
        return sum(len(wakes) for wakes in list(self._subscribers.values()))

    async def read(self, function: Callable[[Session], T]) -> T:
        """function(session) in a worker thread (at most max_concurrent_reads at once), in a session
        of its own that is closed, never committed, afterwards."""
        self._bind()

        def in_session() -> T:
            with Session(self.engine) as session:
                return function(session)

        return await anyio.to_thread.run_sync(in_session, limiter=self._limiter)

    async def wait(self, wake: asyncio.Event, last_read: float) -> None:
        """Until the subscriber should read again: woken (but not sooner than min_read_interval_s
        after its last read) or refresh_interval_s after its last read, whichever is first."""
        loop = asyncio.get_running_loop()
        with anyio.move_on_after(max(0.0, last_read + self.refresh_interval_s - loop.time())):
            await wake.wait()
            await anyio.sleep(max(0.0, last_read + self.min_read_interval_s - loop.time()))
        wake.clear()


# -- PostgreSQL: wake-ups across server processes ----------------------------------------------------


class PostgresRelay:
    """Wake-ups across the server processes of one PostgreSQL database.

    publish(run_id) returns at once; a sender thread turns the run ids published since its last pass
    into NOTIFY CHANNEL, '<run_id>' (one short transaction per pass, duplicates merged). A listener
    thread holds its own autocommit connection with LISTEN CHANNEL and calls on_notify(run_id) for each
    notification, this process's own included, and on_reconnect() after every (re)connect, since
    notifications sent while it was away are lost; a dropped connection is reopened with backoff
    (0.5 s doubling up to max_backoff_s). The listener checks for stop() every poll_s and, when idle
    for keepalive_s, sends a query so that a silently dead connection shows."""

    def __init__(
        self,
        engine: Engine,
        on_notify: Callable[[str], object],
        on_reconnect: Callable[[], object],
        *,
        channel: str = CHANNEL,
        poll_s: float = 0.25,
        keepalive_s: float = 15.0,
        max_backoff_s: float = 10.0,
    ) -> None:
        if not channel.isidentifier():
            raise ValueError(f"channel {channel!r} is not a plain identifier")
        self.engine = engine
        self.channel = channel
        self._on_notify = on_notify
        self._on_reconnect = on_reconnect
        self._poll_s = poll_s
        self._keepalive_s = keepalive_s
        self._max_backoff_s = max_backoff_s
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._send_wakeup = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connected = threading.Event()  # the listener is listening (tests wait for it)

    def start(self) -> PostgresRelay:
        if not self._threads:
            self._stopping.clear()
            self._threads = [
                threading.Thread(target=self._send_loop, name="gradwatch-live-notify", daemon=True),
                threading.Thread(target=self._listen_loop, name="gradwatch-live-listen", daemon=True),
            ]
            for thread in self._threads:
                thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is pending, stop both threads (idempotent)."""
        self._stopping.set()
        self._send_wakeup.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def publish(self, run_id: str) -> None:
        """Have NOTIFY sent for the run soon; returns at once, from any thread."""
        with self._lock:
            self._pending.add(run_id)
        self._send_wakeup.set()

    def _send_loop(self) -> None:
        failures = 0
        while True:
            self._send_wakeup.wait()
            self._send_wakeup.clear()
            with self._lock:
                run_ids, self._pending = self._pending, set()
            if run_ids:
                try:
                    with self.engine.connect() as connection:
                        # The notification goes out at commit; nothing here needs to wait for the disk.
                        connection.execute(text("SET LOCAL synchronous_commit TO OFF"))
                        for run_id in sorted(run_ids):
                            connection.execute(select(func.pg_notify(self.channel, run_id)))
                        connection.commit()
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - keep the ids and retry; never let the thread die
                    failures += 1
                    delay = min(self._max_backoff_s, 0.5 * 2 ** (failures - 1))
                    if failures == 1:
                        logger.warning("gradwatch: live NOTIFY failed (%s); retrying", exc)
                    with self._lock:
                        self._pending |= run_ids
                    if self._stopping.wait(delay):
                        return
                    self._send_wakeup.set()
                    continue
            if self._stopping.is_set():
                return

    def _conninfo(self) -> str:
        return self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def _listen_loop(self) -> None:
        import psycopg

        failures = 0
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._conninfo(), autocommit=True, connect_timeout=5, application_name="gradwatch-live"
                ) as connection:
                    connection.execute(f"LISTEN {self.channel}")
                    self.connected.set()
                    if failures:
                        logger.warning("gradwatch: live listener reconnected")
                    failures = 0
                    self._on_reconnect()  # whatever was notified while nobody listened
                    self._listen(connection)
            except Exception as exc:  # noqa: BLE001 - reconnect with backoff; never let the thread die
                self.connected.clear()
                if self._stopping.is_set():
                    return
                failures += 1
                delay = min(self._max_backoff_s, 0.5 * 2 ** (failures - 1))
                logger.warning(
                    "gradwatch: live listener lost its connection (%s); retrying in %.1f s", exc, delay
                )
                self._stopping.wait(delay)
        self.connected.clear()

    def _listen(self, connection: Any) -> None:
        last_used = time.monotonic()
        while not self._stopping.is_set():
            for notification in connection.notifies(timeout=self._poll_s):
                last_used = time.monotonic()
                self._on_notify(notification.payload)
                if self._stopping.is_set():
                    return
            if time.monotonic() - last_used > self._keepalive_s:  # a silently dead connection shows here
                connection.execute("SELECT 1")
                last_used = time.monotonic()

