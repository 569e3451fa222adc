"""The sender: the training thread only appends packets to an inbox; two worker threads do the rest.

    training thread --submit()--> inbox: a bounded deque; append is constant-time, takes no lock,
                                  and a full inbox drops the packet and counts its points
    collector thread: inbox -> Packet.resolve() (device values are read here) -> wire fragments ->
                      pending; while the server is failing, pending is sealed into batches (each gets
                      its seq once) and written to the spool file, so the inbox never fills
    uploader thread:  the spool's oldest batch -- or, when the spool is empty, everything pending
                      sealed into one batch -- is POSTed; success frees it; a retryable failure writes
                      what is in memory to the spool and waits (exponential backoff with jitter, or
                      the server's Retry-After when longer); a refusal (4xx other than 408/429)
                      drops the batch and counts its points

Pending data is merged while the uploader is busy, so a slow server gets fewer, larger batches
instead of an ever-growing backlog, each within what servers accept (max_batch_points points,
MAX_BATCH_VALUES numbers: split_by_steps). Seqs: a batch's seq is (namespace << 20) + counter, where the
namespace is the wall-clock millisecond at which this sender started (strictly increasing within a
process; a new one after 2^20 batches). A resumed process of the same run and rank therefore never
reuses a seq of an earlier process (its clock has moved on), with no counter to persist, and a
batch keeps its seq through the spool, so retries and replays are stored once by the server.

close() is idempotent and bounded by its timeout; what is left then is written to the spool file.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ._buffer import Packet, Resolved
from ._spool import Spool
from ._transport import Transport, TransportError
from ._wire import HEALTH_PREFIX, batch_points, group_fragments, last_step, merge_fragments

logger = logging.getLogger("gradwatch")

SEQ_COUNTER_BITS = 20
_namespace_lock = threading.Lock()
_last_namespace = 0


def _new_namespace() -> int:
    """The current wall-clock millisecond, strictly above every namespace this process used."""
    global _last_namespace
    with _namespace_lock:
        _last_namespace = max(int(time.time() * 1000), _last_namespace + 1)
        return _last_namespace


class SeqAllocator:
    """Batch sequence numbers, unique per (run, rank) across processes: see the module docstring."""

    def __init__(self) -> None:
        self._namespace = _new_namespace()
        self._count = 0
        self.first = self._namespace << SEQ_COUNTER_BITS  # no seq of an earlier process reaches this

    def next(self) -> int:
        if self._count >= 1 << SEQ_COUNTER_BITS:
            self._namespace, self._count = _new_namespace(), 0
        self._count += 1
        return (self._namespace << SEQ_COUNTER_BITS) | (self._count - 1)


@dataclass
class Backoff:
    """Exponential backoff with jitter: the n-th failure in a row waits min(cap, base·2^(n-1)) seconds
    times a random factor in [0.5, 1), so many agents recovering together do not retry in step."""

    base: float = 0.25
    cap: float = 30.0
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(
                f"backoff needs 0 < base <= cap (seconds), got base={self.base!r}, cap={self.cap!r}"
            )

    def next_delay(self) -> float:
        self.failures += 1
        return min(self.cap, self.base * 2.0 ** min(self.failures - 1, 30)) * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


@dataclass(frozen=True)
class SenderStats:
    """The agent's own health, in points (one point = one key at one step).

    queued: waiting in memory; spooled: waiting in the spool file; sent: acknowledged by the server;
    dropped: lost, each for a reason logged once (inbox full, spool and memory full, refused by the
    server); last_error: the most recent failure's message, if any.
    """

    queued: int = 0
    sent: int = 0
    spooled: int = 0
    dropped: int = 0
    sent_batches: int = 0
    last_error: str | None = None

    @property
    def sent_points(self) -> int:
        return self.sent

    @property
    def dropped_points(self) -> int:
        return self.dropped


def to_fragment(resolved: Resolved, status: str | None) -> dict[str, Any]:
    """The data part of a wire batch (no rank or seq yet) for one flush."""
    fragment: dict[str, Any] = dict(resolved.wire_fields())
    if status is not None:
        fragment["status"] = status
    return fragment


def packet_points(packet: Packet) -> int:
    return len(packet.slots) + len(packet.host_scalars)


# The most numbers one batch carries (a vector row holds one per layer, a histogram layers x bins): a
# server refuses larger batches (gradwatch.server.ingest_limits, 2,000,000 by default).
MAX_BATCH_VALUES = 1_000_000


def split_by_steps(batch: dict[str, Any], max_points: int, max_values: int) -> list[dict[str, Any]]:
    """A sealed batch's data as consecutive step ranges of at most `max_points` points and `max_values`
    numbers each ([batch] when it fits): servers refuse larger batches. A step's keys stay together
    (alert rules read them side by side); a single step larger than the limits is a piece of its own.
    Events go with their steps, "layers" with every piece, the status (and any other field) with the last."""
    scalar_points = sum(len(series["steps"]) for series in batch.get("scalars", ()))
    vector_rows = [row for series in batch.get("vectors", ()) for row in series["values"]]
    histograms = batch.get("histograms", ())
    if (
        scalar_points + len(vector_rows) + len(histograms) <= max_points
        and scalar_points + sum(map(len, vector_rows)) + sum(len(r) for h in histograms for r in h["counts"])
        <= max_values
    ):
        return [batch]  # the usual case, counted without a dict per step
    sizes: dict[int, list[int]] = {}  # step -> [points, numbers]
    for series in batch.get("scalars", ()):
        for step in series["steps"]:
            sizes.setdefault(step, [0, 0])
            sizes[step][0] += 1
            sizes[step][1] += 1
    for series in batch.get("vectors", ()):
        for step, row in zip(series["steps"], series["values"], strict=True):
            sizes.setdefault(step, [0, 0])
            sizes[step][0] += 1
            sizes[step][1] += len(row)
    for histogram in batch.get("histograms", ()):
        sizes.setdefault(histogram["step"], [0, 0])
        sizes[histogram["step"]][0] += 1
        sizes[histogram["step"]][1] += sum(map(len, histogram["counts"]))
    starts: list[int] = []  # the first step of each piece
    points = values = 0
    for step in sorted(sizes):
        step_points, step_values = sizes[step]
        if starts and points + step_points <= max_points and values + step_values <= max_values:
            points, values = points + step_points, values + step_values
        else:
            starts.append(step)
            points, values = step_points, step_values
    pieces = []
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else None
        first = index == 0

        def within(step: int, start: int = start, end: int | None = end, first: bool = first) -> bool:
            return (first or step >= start) and (end is None or step < end)

        piece: dict[str, Any] = {
            "scalars": _series_within(batch.get("scalars", ()), within),
            "events": [event for event in batch.get("events", ()) if within(event["step"])],
        }
        vectors = _series_within(batch.get("vectors", ()), within)
        if vectors:
            piece["vectors"] = vectors
        histograms = [h for h in batch.get("histograms", ()) if within(h["step"])]
        if histograms:
            piece["histograms"] = histograms
        pieces.append(piece)
    for name, value in batch.items():
        if name == "layers":
            for piece in pieces:
                piece[name] = value
        elif name not in ("scalars", "events", "vectors", "histograms"):
            pieces[-1][name] = value
    return pieces


def _series_within(series_list: Any, within: Any) -> list[dict[str, Any]]:
    """The series (scalar or vector) cut to the steps `within` accepts; series left empty are left out."""
    out = []
    for series in series_list:
        kept = [
            (step, value)
            for step, value in zip(series["steps"], series["values"], strict=True)
            if within(step)
        ]
        if kept:
            out.append(
                {**series, "steps": [step for step, _ in kept], "values": [value for _, value in kept]}
            )
    return out


_SENT, _REFUSED, _RETRY = "sent", "refused", "retry"


class Sender:
    """Moves one run's packets to the server (or, with transport None, to the spool file only)."""

    def __init__(
        self,
        transport: Transport | None,
        run_document: dict[str, Any],
        rank: int,
        spool: Spool | None = None,
        *,
        max_queue: int = 1024,
        max_batch_points: int = 50_000,
        spill_after: float = 1.0,
        backoff: Backoff | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        """max_queue: packets the inbox holds; max_batch_points: largest merged batch; spill_after:
        seconds pending data waits before it is sealed into the spool while the server is failing;
        poll_interval: seconds between the collector's looks at the inbox."""
        if max_queue < 1 or max_batch_points < 1:
            raise ValueError(
                f"max_queue and max_batch_points must be >= 1, got {max_queue!r}, {max_batch_points!r}"
            )
        self.transport = transport
        self.run_document = run_document
        self.run_id = run_document["id"]
        self.rank = rank
        self.spool = spool if spool is not None else Spool(None, run_document, rank)
        self._max_queue = max_queue
        self._max_batch_points = max_batch_points
        self._spill_after = spill_after
        self._poll_interval = poll_interval
        self._backoff = backoff or Backoff()
        self._seqs = SeqAllocator()
        self._inbox: deque[tuple[Packet, int]] = deque()
        # Counters with a single writer each, so the training thread never takes a lock.
        self._submitted = 0  # training thread
        self._rejected = 0  # training thread: points of packets refused by a full inbox
        self._taken = 0  # collector
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: list[dict[str, Any]] = []  # fragments not sealed yet (under _lock)
        self._pending_points = 0
        self._pending_since = 0.0
        self._sent = self._sent_batches = self._dropped = 0
        self._last_error: str | None = None
        self._failing = False  # the last upload attempt failed and may be retried
        self._server_wait = 0.0  # seconds the server asked the last failed attempt to wait (Retry-After)
        self._run_created = False
        self._warned: set[str] = set()
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._collector_done = False
        self._closed = False
        self._forked = False
        self._collector = threading.Thread(target=self._collect, name="gradwatch-collector", daemon=True)
        self._uploader = (
            threading.Thread(target=self._upload, name="gradwatch-uploader", daemon=True)
            if transport
            else None
        )
        self._collector.start()
        if self._uploader is not None:
            self._uploader.start()

    # -- training thread --------------------------------------------------------------------------

    def submit(self, packet: Packet) -> bool:
        """Hand a packet to the sender without waiting; False (points counted as dropped) when full."""
        if self._forked:
            return False
        points = packet_points(packet)
        if self._closed:
            self._rejected += points
            self._warn_once(
                "closed", "gradwatch: data logged after finish() is dropped (counted in run.stats.dropped)"
            )
            return False
        if len(self._inbox) >= self._max_queue:
            self._rejected += points
            self._warn_once(
                "inbox",
                "gradwatch: the send queue is full (%d packets); dropping data, counted in run.stats.dropped",
                self._max_queue,
            )
            return False
        self._inbox.append((packet, points))
        self._submitted += points
        return True

    @property
    def stats(self) -> SenderStats:
        """A snapshot of the counters (read without locks: each is written by one thread)."""
        spool = self.spool
        return SenderStats(
            queued=max(self._submitted - self._taken, 0) + self._pending_points + spool.memory_points,
            sent=self._sent,
            spooled=spool.disk_points,
            dropped=self._rejected + self._dropped + spool.dropped_points,
            sent_batches=self._sent_batches,
            last_error=self._last_error,
        )

    def close(self, timeout: float) -> bool:
        """Send what is queued for at most `timeout` seconds, then write what is left to the spool
        file. True when everything reached the server (offline: the file). Idempotent."""
        if self._forked:
            return True
        if not self._closed:
            self._closed = True
            self._deadline = time.monotonic() + max(timeout, 0.0)
            self._closing.set()
            with self._changed:
                self._changed.notify_all()
            self._collector.join(max(self._deadline - time.monotonic(), 0.0) + 1.0)
            if self._uploader is not None:
                self._uploader.join(max(self._deadline - time.monotonic(), 0.0) + 0.1)
            with self._lock:
                # Whatever is still here must survive the process: `gradwatch sync` or a resumed run
                # sends it. A batch an uploader still has in flight may be written too; its seq makes
                # the second copy a no-op on the server.
                if self._pending:
                    self._seal_pending(persist=True)
                self.spool.persist()
                self.spool.fsync()
        left = len(self.spool) if self.transport is not None else self.spool.memory_entries
        return not self._inbox and not self._pending and not left

    def forget_after_fork(self) -> None:
        """In a forked child: the worker threads do not exist here and the locks may be held
        forever, so never touch them; submit() and close() become no-ops."""
        self._forked = True
        self._inbox = deque()

    # -- collector thread -------------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            closing = self._closing.is_set()  # read first: packets submitted before close() are taken
            try:
                while self._inbox:
                    packet, points = self._inbox.popleft()
                    self._take(packet, points)
                with self._lock:
                    self._seal_if_due(closing)
            except Exception as exc:  # noqa: BLE001 - the worker must not die silently
                self._error(exc, "collector")
            if closing:
                with self._changed:
                    self._collector_done = True
                    self._changed.notify_all()
                return
            self._closing.wait(self._poll_interval)

    def _take(self, packet: Packet, points: int) -> None:
        try:
            fragment = to_fragment(packet.resolve(), packet.status)
        except Exception as exc:  # noqa: BLE001 - one bad packet must not stop the others
            with self._lock:
                self._dropped += points
            self._error(exc, "resolve")
            return
        finally:
            self._taken += points
        with self._changed:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(fragment)
            self._pending_points += batch_points(fragment)
            self._changed.notify_all()

    def _seal_if_due(self, closing: bool) -> None:
        """(under _lock) Seal pending data into the spool when it must not wait for the uploader."""
        if not self._pending:
            return
        offline = self.transport is None
        backlog = self._failing or len(self.spool) > 0
        aged = time.monotonic() - self._pending_since >= self._spill_after
        big = self._pending_points >= self._max_batch_points
        if (closing and offline) or big or (aged and (offline or backlog)):
            self._seal_pending(persist=offline or self._failing)

    def _seal_pending(self, persist: bool) -> None:
        """(under _lock) Turn pending fragments into batches with their seq, and hand them to the spool."""
        fragments, self._pending, self._pending_points = self._pending, [], 0
        for group in group_fragments(fragments, self._max_batch_points):
            for data in split_by_steps(merge_fragments(group), self._max_batch_points, MAX_BATCH_VALUES):
                points = batch_points(data)
                batch = {"rank": self.rank, "seq": self._seqs.next(), **data}
                self._add_health(batch)
                self.spool.add(batch, points, persist)  # no room at all: the spool counts it and warns once

    def _add_health(self, batch: dict[str, Any]) -> None:
        """The agent's own counters as scalars at the batch's last step (excluded from point counts)."""
        step = last_step(batch)
        if step is None:
            return
        stats = self.stats
        batch["scalars"] = list(batch.get("scalars", [])) + [
            {"key": f"{HEALTH_PREFIX}{name}", "steps": [step], "values": [float(getattr(stats, name))]}
            for name in ("queued", "sent", "spooled", "dropped")
        ]

    # -- uploader thread --------------------------------------------------------------------------

    def _upload(self) -> None:
        try:
            self.spool.check_writable()  # file system calls, outside the lock: the collector goes on
            leftovers = self.spool.scan_leftovers()
            with self._lock:
                found = self.spool.adopt(leftovers, older_than=self._seqs.first)
            if found:
                logger.info(
                    "gradwatch: run %s: replaying %d points left in %s", self.run_id, found, self.spool.path
                )
        except Exception as exc:  # noqa: BLE001
            self._error(exc, "spool")
        while True:
            try:
                if not self._upload_once():
                    return
            except Exception as exc:  # noqa: BLE001 - the worker must not die silently
                self._error(exc, "uploader")
                if self._wait(1.0):
                    return

    def _upload_once(self) -> bool:
        """One attempt at the oldest batch; False when the uploader is done (all sent, or deadline)."""
        with self._changed:
            while True:
                if time.monotonic() >= self._deadline:
                    return False
                if not len(self.spool) and self._pending and not self._failing:
                    self._seal_pending(persist=False)
                head = self.spool.oldest()
                if head is not None:
                    break
                if self._collector_done and not self._pending:
                    return False
                self._changed.wait(min(0.5, max(self._deadline - time.monotonic(), 0.0)))
        seq, batch, points = head
        outcome = self._attempt(batch)
        with self._lock:
            if outcome == _SENT:
                self.spool.remove(seq)
                self._sent += points
                self._sent_batches += 1
                if self._failing:
                    logger.info(
                        "gradwatch: run %s: server reachable again; sending the %d spooled points",
                        self.run_id,
                        self.spool.points,
                    )
                self._failing = False
                self._backoff.reset()
                return True
            if outcome == _REFUSED:
                self.spool.remove(seq)
                self._dropped += points
                return True
            if not self._failing:
                self._failing = True
                self.spool.persist()
            delay = max(self._backoff.next_delay(), self._server_wait)  # the server's Retry-After, if longer
        return not self._wait(delay)

    def _wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, no later than close()'s deadline; True when the deadline has passed."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return True
        if self._closing.is_set():
            time.sleep(min(seconds, remaining))
        else:
            self._closing.wait(seconds)  # close() cuts a long backoff short: one prompt last try
        return time.monotonic() >= self._deadline

    def _attempt(self, batch: dict[str, Any] | bytes) -> str:
        assert self.transport is not None
        self._server_wait = 0.0
        try:
            if not self._run_created:
                self._adopt(self.transport.create_run(self.run_document))
                self._run_created = True
            if isinstance(batch, bytes):
                send_encoded = getattr(self.transport, "send_encoded", None)
                if send_encoded is not None:
                    send_encoded(self.run_id, batch)
                else:
                    self.transport.send_batch(self.run_id, json.loads(batch))
            else:
                self.transport.send_batch(self.run_id, batch)
            return _SENT
        except TransportError as exc:
            self._last_error = str(exc)
            self._server_wait = getattr(exc, "retry_after", None) or 0.0
            if exc.status == 404:
                self._run_created = False  # the server lost the run (a new database): create it again
            if exc.retryable or exc.status == 404:
                self._warn_unreachable(exc)
                return _RETRY
            self._warn_once(
                "refused",
                "gradwatch: run %s: the server refused a batch, which is dropped and "
                "counted in run.stats.dropped: %s",
                self.run_id,
                exc,
            )
            return _REFUSED
        except Exception as exc:  # noqa: BLE001 - a custom transport's own failure: try again later
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._warn_unreachable(exc)
            return _RETRY

    def _adopt(self, created: Any) -> None:
        """Send to the id the server gave the run: it differs from ours only when another project had
        our id already (the server never lets one project squat another's ids)."""
        given = created.get("id") if isinstance(created, dict) else None
        if isinstance(given, str) and given and given != self.run_id:
            logger.warning(
                "gradwatch: run id %s is another project's on the server; this run is stored as %s",
                self.run_id,
                given,
            )
            self.run_id = given

    def _warn_unreachable(self, exc: BaseException) -> None:
        if not self._failing:  # once per outage
            where = f"the spool file {self.spool.path}" if self.spool.writable else "memory"
            logger.warning(
                "gradwatch: run %s: cannot reach the server (%s); data waits in %s and is retried "
                "with backoff",
                self.run_id,
                exc,
                where,
            )

    # -- helpers ----------------------------------------------------------------------------------

    def _error(self, exc: BaseException, where: str) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("gradwatch: internal error in the %s: %s", where, exc, exc_info=exc)

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
