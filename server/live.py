"""Live streams: a run's new points, events and status pushed to WebSocket subscribers within a second
of ingest, on one server process or many.

    ingest (a threadpool thread)                                      the event loop
    Store.after_commit → LiveHub.after_commit ─ SQLite ─ call_soon_threadsafe → wake the run's subscribers
                                              └ PostgreSQL: PostgresRelay.publish
                                                → NOTIFY gradwatch_live, '<run_id>'
    every server process: PostgresRelay's LISTEN thread ─ call_soon_threadsafe → wake …

A wake-up carries no data, only a run id: each subscriber then reads what is new for it from the
database (gradwatch.server.storage.live: LiveReads.read_new, in a worker thread) from its own cursor,
the last step sent per (key, rank) and the last event sent per rank. So a notification may be lost,
repeated or merged with others without a point being lost or sent twice; late data of a rank that lags
behind the others is still sent; nothing depends on how much a batch held. A subscriber whose read is
in flight is only marked dirty (no queue grows, however slow its client), and every subscriber reads
every refresh_interval_s anyway, so a NOTIFY missed while the listener reconnects delays data instead
of losing it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import Engine, func, select, text

from .schemas import BatchIn

__all__ = ["CHANNEL", "LiveHub", "PostgresRelay", "RunsWatch"]

logger = logging.getLogger("gradwatch.live")

CHANNEL = "gradwatch_live"  # the PostgreSQL notification channel; the payload is a run id
REFRESH_INTERVAL_S = 5.0  # every subscriber reads at least this often, notified or not
MIN_READ_INTERVAL_S = 0.05  # a subscriber reads at most this often (wake-ups in between are merged)
MAX_CONCURRENT_READS = 4  # live reads in worker threads at once per process (ingest keeps the rest)

T = TypeVar("T")


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
        self._watches: set[RunsWatch] = set()  # subscribers to every run's news (the runs list)
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
        for watch in self._watches:
            watch.moved(run_id)

    def notify_all(self) -> None:
        for wakes in self._subscribers.values():
            for wake in wakes:
                wake.set()
        for watch in self._watches:
            watch.moved(None)

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

    @contextmanager
    def watch_runs(self) -> Iterator[RunsWatch]:
        """A RunsWatch told of every run's news, registered until the block ends."""
        self._bind()
        watch = RunsWatch()
        self._watches.add(watch)
        try:
            yield watch
        finally:
            self._watches.discard(watch)

    def subscriber_count(self, run_id: str | None = None) -> int:
        """Open subscriptions (of one run); safe to call from any thread."""
        if run_id is not None:
            return len(self._subscribers.get(run_id, ()))
        return sum(len(wakes) for wakes in list(self._subscribers.values()))

    async def read(self, function: Callable[[], T]) -> T:
        """function() (a database read: LiveReads) in a worker thread, at most max_concurrent_reads
        at once."""
        self._bind()
        return await anyio.to_thread.run_sync(function, limiter=self._limiter)

    async def wait(self, wake: asyncio.Event, last_read: float) -> None:
        """Until the subscriber should read again: woken (but not sooner than min_read_interval_s
        after its last read) or refresh_interval_s after its last read, whichever is first."""
        loop = asyncio.get_running_loop()
        with anyio.move_on_after(max(0.0, last_read + self.refresh_interval_s - loop.time())):
            await wake.wait()
            await anyio.sleep(max(0.0, last_read + self.min_read_interval_s - loop.time()))
        wake.clear()


class RunsWatch:
    """What a subscriber to every run (the runs list's doorbell) has not been told yet: the ids of the
    runs that moved, or None among them when any may have (a listener that reconnected)."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self._moved: set[str | None] = set()

    def moved(self, run_id: str | None) -> None:
        if len(self._moved) < MAX_WATCHED_MOVES:
            self._moved.add(run_id)
        else:
            self._moved = {None}  # too many to look up: any may have moved
        self.wake.set()

    def take(self) -> set[str | None]:
        """The runs that moved since the last take (on the event loop)."""
        moved, self._moved = self._moved, set()
        self.wake.clear()
        return moved


MAX_WATCHED_MOVES = 1_000


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
