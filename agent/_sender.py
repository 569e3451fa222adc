"""The sender: the training thread only appends packets to an inbox; two worker threads do the rest.

    training thread --submit()--> inbox: a bounded deque; append is constant-time, takes no lock,
                                  and a full inbox drops the packet and counts its points
    collector thread: inbox -> Packet.resolve() (device values are read here) -> wire fragments ->
                      pending; while the server is failing, pending is sealed into batches (each gets
                      its seq once) and written to the spool file, so the inbox never fills
    uploader thread:  the spool's oldest batch -- or, when the spool is empty, everything pending
                      sealed into one batch -- is POSTed; success frees it; a failure writes what is
                      in memory to the spool and waits (exponential backoff with jitter, or the
                      server's Retry-After when longer) before the next try

What a failure means for a batch (retried, split, dead-lettered beside the spool and retried by
`gradwatch sync`) is gradwatch._dead_letters': a broken server never empties the spool into dead
letters, and a wrong token never drops data.

Pending data is merged while the uploader is busy, so a slow server gets fewer, larger batches
instead of an ever-growing backlog, each within what servers accept (max_batch_points points,
MAX_BATCH_VALUES numbers: split_by_steps). Seqs: a batch's seq is (namespace << 20) + counter, where the
namespace is the wall-clock millisecond at which this sender started (strictly increasing within a
process; a new one after 2^20 batches). A resumed process of the same run and rank therefore never
reuses a seq of an earlier process (its clock has moved on), with no counter to persist, and a
batch keeps its seq through the spool, so retries and replays are stored once by the server.

close() drains while the server makes progress: it returns once everything is stored, or when nothing
moved (no batch stored, split or dead-lettered, no packet taken) for `stall_timeout` seconds, or at
its `timeout` when one is given; what is left then is written to the spool file. While a backlog
uploads, a progress line goes to stderr every PROGRESS_EVERY seconds. Idempotent.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._buffer import Packet, Resolved, host_points
from ._dead_letters import REFUSAL_TRIES, SERVER_ERROR_TRIES, BatchFaults
from ._spool import DeadLetters, Spool, dead_letter_path
from ._transport import Backoff, HttpTransport, Transport, TransportError
from ._wire import (
    HEALTH_PREFIX,
    MAX_BATCH_VALUES,
    STEPS_I64,
    VALUES_F64,
    SeqAllocator,
    batch_points,
    dumps,
    group_fragments,
    halve_by_steps,
    last_step,
    merge_fragments,
    pack_values,
    split_by_steps,
    unpack_values,
)

logger = logging.getLogger("gradwatch")

# close(): seconds without progress after which it stops waiting for the server.
DEFAULT_STALL_TIMEOUT = 30.0
# close(): seconds between progress lines on stderr (the first after as long: a quick close is silent).
PROGRESS_EVERY = 3.0
# An idle run (a long evaluation, a checkpoint save) still tells the server it is alive this often:
# the server marks a run whose ranks all stayed silent for crashed_after_s (5 min) "crashed".
KEEPALIVE_S = 60.0
# Sealed batches the collector encodes ahead of the uploader (each at most max_batch_points points).
ENCODE_AHEAD = 2
_UNAVAILABLE = frozenset({408, 429, 502, 503, 504})  # the server (or its proxy) is away or busy
_AUTH = frozenset({401, 403})


@dataclass(frozen=True)
class SenderStats:
    """The agent's own health, in points (one point = one key at one step).

    queued: waiting in memory; spooled: waiting in the spool file; sent: acknowledged by the server;
    dropped: lost, each for a reason logged once (inbox full, spool and memory full, refused by the
    server with no dead-letter file to keep it); dead_lettered: refused by the server for good and
    kept in the dead-letter file for `gradwatch sync`; last_error: the most recent failure's message,
    if any.
    """

    queued: int = 0
    sent: int = 0
    spooled: int = 0
    dropped: int = 0
    sent_batches: int = 0
    last_error: str | None = None
    dead_lettered: int = 0
    dead_lettered_batches: int = 0

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
    return len(packet.slots) + host_points(packet.host_scalars)


# What one try of a batch came to (see the module docstring).
_SENT = "sent"
_WAIT = "wait"  # the server is away, busy, or refuses the token: not this batch's fault
_FAULT = "fault"  # a server error that may be this batch's
_REFUSED = "refused"  # a 4xx refusal of this batch
_TOO_LARGE = "too large"  # 413


def _notice(message: str) -> None:
    """A line for the person watching (progress): logged at INFO on the "gradwatch" logger when the
    application shows that logger's INFO records, else written to stderr; nothing when the
    application set the logger's level above INFO (or disabled it)."""
    if logger.disabled or logger.level > logging.INFO:
        return
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message)
        return
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # no usable stderr (closed, or a daemon's None)
        pass


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
        dead_letters: DeadLetters | None = None,
        server_error_tries: int = SERVER_ERROR_TRIES,
        refusal_tries: int = REFUSAL_TRIES,
        hold: bool = False,
    ) -> None:
        """max_queue: packets the inbox holds; max_batch_points: largest merged batch; spill_after:
        seconds pending data waits before it is sealed into the spool while the server is failing;
        poll_interval: seconds between the collector's looks at the inbox; dead_letters: where
        refused batches go (default: the dead-letter file beside the spool file, if it has one);
        server_error_tries / refusal_tries: see the module docstring; hold: the run's id and rank are
        not settled yet -- packets are taken, but nothing is sealed, spooled or sent until release()."""
        if max_queue < 1 or max_batch_points < 1:
            raise ValueError(
                f"max_queue and max_batch_points must be >= 1, got {max_queue!r}, {max_batch_points!r}"
            )
        self.transport = transport
        self.run_document = run_document
        self.run_id = run_document["id"]
        self.rank = rank
        self.spool = spool if spool is not None else Spool(None, run_document, rank)
        if dead_letters is None and self.spool.path is not None:
            dead_letters = DeadLetters(dead_letter_path(self.spool.path), run_document, rank)
        self._faults = BatchFaults(dead_letters, server_error_tries, refusal_tries)
        self._max_queue = max_queue
        self._max_batch_points = max_batch_points
        self._spill_after = spill_after
        self._poll_interval = poll_interval
        self._backoff = backoff or Backoff()
        self._seqs = SeqAllocator()
        self._superseded_warned = False  # a resume by another process cut our data (said once)
        # Told the id the server stores the run under, when it is not ours (a squatted id).
        self.on_renamed: Callable[[str], None] | None = None
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
        self._newest_step = 0  # the largest step sealed so far (a notice about a stepless batch)
        self._packed = False  # the server reads values_f64 (it said so when the run was created)
        self._packed_steps = False  # ... and steps_i64
        self._encoded: dict[int, bytes] = {}  # seq -> JSON of a sealed batch, encoded ahead (_encode_ahead)
        self._sealed_at: float | None = None  # when a batch was last sealed (None: never yet)
        self._run_created = False
        self._warned: set[str] = set()
        self._closing = threading.Event()
        self._stop = threading.Event()  # close() stopped waiting: the workers end now
        self._deadline = float("inf")
        self._progress_at = time.monotonic()  # the last time something moved (see close())
        self._collector_done = False
        self._closed = False
        self._forked = False
        self.close_reason: str | None = None  # after close(): None (all done), "stalled" or "timeout"
        self._released = threading.Event()  # see release()
        if not hold:
            self._released.set()
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
            dead_lettered=self._faults.points,
            dead_lettered_batches=self._faults.batches,
        )

    @property
    def failing_reason(self) -> str | None:
        """The last error when the latest try failed (the server is not taking data now), else None."""
        return self._last_error if self._failing else None

    @property
    def last_refusal(self) -> str | None:
        """Why the latest dead-lettered batch was refused, if any was."""
        return self._faults.last_refusal

    def close(self, timeout: float | None = None, stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> bool:
        """Send what is queued while the server makes progress, then write what is left to the
        spool file. Returns True when everything reached the server (offline: the file).

        Waits until everything is stored, or until nothing has moved for `stall_timeout` seconds
        (the server is down, refuses the token, or fails every batch), or `timeout` seconds in all
        when given; close_reason then says which ("stalled", "timeout"). While it waits longer than
        PROGRESS_EVERY seconds, a progress line goes to stderr that often. Idempotent."""
        if self._forked:
            return True
        if not self._closed:
            self._closed = True
            self.release()  # a sender still on hold sends under the id it has
            started = time.monotonic()
            self._deadline = started + max(timeout, 0.0) if timeout is not None else float("inf")
            self._progress_at = started
            self._closing.set()
            with self._changed:
                self._changed.notify_all()
            self.close_reason = self._drain(started, max(stall_timeout, 0.0))
            self._stop.set()
            with self._changed:
                self._changed.notify_all()
            self._collector.join(1.0)  # a collector stuck reading device values is left behind
            if self._uploader is not None:
                self._uploader.join(0.1)  # one in the middle of a request is left to finish it
            uploading = self._uploader is not None and self._uploader.is_alive()
            if isinstance(self.transport, HttpTransport) and not uploading:
                self.transport.close()  # its kept-alive connection
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

    def _drain(self, started: float, stall_timeout: float) -> str | None:
        """close()'s wait: None when the workers are done, else why it stopped waiting."""
        done_before = self._done_points()
        worker = self._uploader or self._collector
        next_line = started + PROGRESS_EVERY
        while worker.is_alive() or self._collector.is_alive():
            now = time.monotonic()
            if now >= self._deadline:
                return "timeout"
            idle = now - self._progress_at
            if idle >= stall_timeout:
                return "stalled"
            if now >= next_line:
                if self._uploader is not None:
                    self._report_progress(done_before, idle, stall_timeout)
                next_line = now + PROGRESS_EVERY
            wake = min(self._deadline, self._progress_at + stall_timeout, next_line)
            waiting_for = worker if worker.is_alive() else self._collector
            waiting_for.join(min(max(wake - now, 0.01), 0.25))
        return None

    def _done_points(self) -> int:
        """Points that have left the queue: stored, dead-lettered or dropped."""
        return self._sent + self._faults.points + self._dropped + self.spool.dropped_points

    def _report_progress(self, done_before: int, idle: float, stall_timeout: float) -> None:
        stats = self.stats
        left = stats.queued + stats.spooled
        done = max(self._done_points() - done_before, 0)
        total = done + left
        if not left:
            return  # only notices or a last request in flight
        line = f"gradwatch: run {self.run_id}: uploading {total:,} points, {100 * done // total}%"
        if idle >= PROGRESS_EVERY:
            why = self.failing_reason
            line += (
                f"; the server has taken nothing for {idle:.0f} s"
                + (f" ({why})" if why else "")
                + f"; giving up after {stall_timeout:.0f} s"
            )
        _notice(line)

    def release(
        self, run_id: str | None = None, rank: int | None = None, spool_path: Path | None = None
    ) -> None:
        """End the hold (see __init__): from now on batches are sealed as `run_id` / `rank` (when
        given; the caller updates run_document) and spooled at `spool_path` (when given). Nothing
        was sealed or written on hold, so nothing needs renaming. A no-op once released."""
        with self._changed:
            if self._released.is_set():
                return
            if run_id is not None:
                self.run_id = self.spool.run_id = run_id
            if rank is not None:
                self.rank = self.spool.rank = rank
            if spool_path is not None:
                self.spool.path = spool_path
                self._faults.file = DeadLetters(dead_letter_path(spool_path), self.run_document, self.rank)
            elif self._faults.file is not None:
                self._faults.file.run_id, self._faults.file.rank = self.run_id, self.rank
            self._released.set()
            self._changed.notify_all()

    @property
    def dead_letter_file(self) -> Path | None:
        """Where batches the server will not take go (None: no spool file, they are dropped)."""
        return self._faults.file.path if self._faults.file is not None else None

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
                    if not closing:
                        self._keep_alive_if_due()
                self.spool.sync_due()  # outside the lock: an fsync must not hold up the uploader
                self._encode_ahead()
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
            self._progress_at = time.monotonic()
        with self._changed:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(fragment)
            self._pending_points += batch_points(fragment)
            self._changed.notify_all()

    def _encode_ahead(self) -> None:
        """Encode the next sealed batches while the uploader waits for the server's answer to the one
        in flight (the JSON of 50,000 points takes tens of milliseconds): the uploader then sends
        bytes, and the agent's encoding overlaps the server's storing instead of alternating with it."""
        if self._failing or getattr(self.transport, "send_encoded", None) is None:
            return
        with self._lock:
            for seq in [seq for seq in self._encoded if not self.spool.holds(seq)]:
                del self._encoded[seq]  # stored, split or dead-lettered meanwhile
            upcoming = self.spool.upcoming(ENCODE_AHEAD)
            todo = [(seq, batch) for seq, batch in upcoming if seq not in self._encoded]
        for seq, batch in todo:
            body = dumps(batch).encode()  # outside the lock: the uploader goes on
            with self._lock:
                if self.spool.holds(seq):
                    self._encoded[seq] = body

    def _seal_if_due(self, closing: bool) -> None:
        """(under _lock) Seal pending data into the spool when it must not wait for the uploader."""
        if not self._pending or not self._released.is_set():
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
                step = last_step(data)
                if self._packed:
                    data = pack_values(data, steps=self._packed_steps)
                batch = {"rank": self.rank, "seq": self._seqs.next(), **data}
                self._add_health(batch, step)
                self.spool.add(batch, points, persist)  # no room at all: the spool counts it and warns once
        self._sealed_at = time.monotonic()

    def _keep_alive_if_due(self) -> None:
        """(under _lock) A sign of life from a run that has sent before and has had nothing to send
        for KEEPALIVE_S: its health counters at its newest step, no other data (the server stores
        them at that step again, and the run's last-seen time moves)."""
        if (
            self.transport is None
            or self._sealed_at is None
            or self._pending
            or len(self.spool)
            or not self._released.is_set()
            or time.monotonic() - self._sealed_at < KEEPALIVE_S
        ):
            return
        batch: dict[str, Any] = {"rank": self.rank, "seq": self._seqs.next()}
        self._add_health(batch, self._newest_step)
        self.spool.add(batch, 0, False)
        self._sealed_at = time.monotonic()

    def _add_health(self, batch: dict[str, Any], step: int | None = None) -> None:
        """The agent's own counters as scalars at the batch's last step, or `step` (excluded from point
        counts); agent/dead_lettered only once a batch was dead-lettered."""
        step = last_step(batch) if step is None else step
        if step is None:
            return
        self._newest_step = max(self._newest_step, step)
        stats = self.stats
        names = ["queued", "sent", "spooled", "dropped"] + (["dead_lettered"] if stats.dead_lettered else [])
        batch["scalars"] = list(batch.get("scalars", [])) + [
            {"key": f"{HEALTH_PREFIX}{name}", "steps": [step], "values": [float(getattr(stats, name))]}
            for name in names
        ]

    # -- uploader thread --------------------------------------------------------------------------

    def _upload(self) -> None:
        self._released.wait()  # the spool's path and the run's id are settled from here on
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
        self._create_run_early()
        while True:
            try:
                if not self._upload_once():
                    return
            except Exception as exc:  # noqa: BLE001 - the worker must not die silently
                self._error(exc, "uploader")
                if self._wait(1.0):
                    return

    def _create_run_early(self) -> None:
        """Create the run on the server before the first batch is sealed: the run shows from the start,
        and its answer says which batch encodings the server reads (values_f64, steps_i64), which
        batches sealed afterwards use. A failure is left to the first batch's attempt, which retries
        and reports it."""
        if self.transport is None or self._run_created:
            return
        try:
            self._adopt(self.transport.create_run(self.run_document))
            self._run_created = True
        except Exception:
            logger.debug("gradwatch: run %s: creating it early failed", self.run_id, exc_info=True)

    def _stopped(self) -> bool:
        return self._stop.is_set() or time.monotonic() >= self._deadline

    def _upload_once(self) -> bool:
        """One attempt at the oldest batch; False when the uploader is done (all sent, or stopped)."""
        with self._changed:
            while True:
                if self._stopped():
                    return False
                # While the server fails, pending data waits to be merged (the collector seals it
                # after spill_after); with the collector done nobody else will.
                if not len(self.spool) and self._pending and (not self._failing or self._collector_done):
                    self._seal_pending(persist=self._failing)
                head = self.spool.oldest()
                if head is not None:
                    break
                if self._collector_done and not self._pending:
                    return False
                self._changed.wait(0.5)
        seq, batch, points = head
        with self._lock:
            encoded = self._encoded.pop(seq, None)
        outcome = self._attempt(batch if encoded is None else encoded)
        with self._lock:
            if outcome == _SENT:
                self._stored(seq, points)
                return True
            refused, probe = self._faults.failed(seq, outcome == _FAULT, outcome == _REFUSED)
            if outcome == _TOO_LARGE:
                if not self._split(seq, batch):
                    self._dead_letter(seq, batch, points, self._last_error or "HTTP 413")
                return True
            if refused:
                self._dead_letter(seq, batch, points, self._last_error or "refused")
                return True
            if not self._failing:
                self._failing = True
                self.spool.persist()
            delay = max(self._backoff.next_delay(), self._server_wait)  # the server's Retry-After, if longer
            reason = self._last_error or "server error"
        if probe and self._probe(seq, batch, points, reason):
            return True
        return not self._wait(delay)

    def _stored(self, seq: int, points: int) -> None:
        """(under _lock) The server has batch `seq`."""
        self.spool.remove(seq)
        self._faults.notices.discard(seq)
        self._sent += points
        self._sent_batches += 1
        self._progress_at = time.monotonic()
        if self._failing:
            logger.info(
                "gradwatch: run %s: server reachable again; sending the %d spooled points",
                self.run_id,
                self.spool.points,
            )
        self._failing = False
        self._faults.restart()
        self._backoff.reset()

    def _probe(self, seq: int, batch: dict[str, Any] | bytes, points: int, reason: str) -> bool:
        """Batch `seq` failed with server errors SERVER_ERROR_TRIES times in a row: send the notice
        that it is dead-lettered. Stored: the server takes other batches, so the fault is this
        one's -- it is dead-lettered (True). Not stored: the server is failing everything; the batch
        stays and its count restarts (False)."""
        if seq in self._faults.notices:  # a notice failing itself proves nothing: it is dropped instead
            with self._lock:
                self._dead_letter(seq, batch, points, reason)
            return True
        with self._lock:
            notice = self._faults.notice(
                self.rank, self._seqs.next(), seq, batch, points, reason, self._newest_step, counted=False
            )
        outcome = self._attempt(notice)
        with self._lock:
            if outcome != _SENT:
                self._faults.restart(seq)
                return False
            self._sent_batches += 1
            self._failing = False
            self._backoff.reset()
            self._dead_letter(seq, batch, points, reason, notice_sent=True)
        return True

    def _dead_letter(
        self, seq: int, batch: dict[str, Any] | bytes, points: int, reason: str, notice_sent: bool = False
    ) -> None:
        """(under _lock) Move a batch the server will not take out of the queue, to the dead-letter
        file; unless it went out already (the probe), queue a notice for the server at its place."""
        self._faults.restart()
        self._progress_at = time.monotonic()
        if seq in self._faults.notices:  # a notice the server will not take: it carries no points
            self._faults.notices.discard(seq)
            self.spool.remove(seq)
            return
        order = self.spool.order_of(seq)
        body = batch if isinstance(batch, bytes) else dumps(batch).encode()
        kept = self._faults.keep(seq, body, points, reason)
        self.spool.retire(seq, "dead_letter")
        if kept:
            self._warn_once(
                "dead_letter",
                "gradwatch: run %s: the server would not take a batch of %d points (%s); it is moved to "
                "%s so the batches after it go on (counted in run.stats.dead_lettered); "
                "`gradwatch sync %s` retries it",
                self.run_id,
                points,
                reason,
                self.dead_letter_file,
                self.dead_letter_file,
            )
        else:
            self._dropped += points
            self._warn_once(
                "dead_letter_dropped",
                "gradwatch: run %s: the server would not take a batch of %d points (%s) and there is no "
                "dead-letter file to keep it in; dropped, counted in run.stats.dropped",
                self.run_id,
                points,
                reason,
            )
        if not notice_sent:
            notice = self._faults.notice(
                self.rank, self._seqs.next(), seq, batch, points, reason, self._newest_step, counted=True
            )
            self._faults.notices.add(notice["seq"])
            self.spool.add(notice, 0, persist=self._failing, order=order)

    def _split(self, seq: int, batch: dict[str, Any] | bytes) -> bool:
        """(under _lock) Replace a batch the server found too large (413) by two halves; False when
        it holds a single step."""
        data = unpack_values(json.loads(batch) if isinstance(batch, bytes) else batch)
        halves = halve_by_steps({k: v for k, v in data.items() if k not in ("rank", "seq")})
        if halves is None:
            return False
        rank = data.get("rank", self.rank)
        pieces = [({"rank": rank, "seq": self._seqs.next(), **half}, batch_points(half)) for half in halves]
        self.spool.replace(seq, pieces)
        self._faults.restart()
        self._progress_at = time.monotonic()
        logger.info(
            "gradwatch: run %s: the server found batch %d too large (%s); sending it in two halves",
            self.run_id,
            seq,
            self._last_error,
        )
        return True

    def _wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, no later than close()'s deadline; True when the uploader must stop."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0 or self._stop.is_set():
            return True
        if self._closing.is_set():
            self._stop.wait(min(seconds, remaining))
        else:
            self._closing.wait(seconds)  # close() cuts a long backoff short: one prompt last try
        return self._stopped()

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
                    ack = send_encoded(self.run_id, batch)
                else:
                    ack = self.transport.send_batch(self.run_id, json.loads(batch))
            else:
                ack = self.transport.send_batch(self.run_id, batch)
            if isinstance(ack, dict) and ack.get("superseded_from") is not None:
                self._warn_superseded(ack["superseded_from"])
            return _SENT
        except TransportError as exc:
            self._last_error = str(exc)
            self._server_wait = getattr(exc, "retry_after", None) or 0.0
            status = exc.status
            if status == 404:
                self._run_created = False  # the server lost the run (a new database): create it again
            if status in _AUTH:
                self._warn_auth(exc)
                return _WAIT
            if status == 413:
                return _TOO_LARGE
            if status in _UNAVAILABLE or status == 404 or (status is None and exc.retryable):
                self._warn_unreachable(exc)
                return _WAIT
            if status is not None and status >= 500:
                self._warn_unreachable(exc)
                return _FAULT
            return _REFUSED
        except Exception as exc:  # noqa: BLE001 - a custom transport's own failure: try again later
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._warn_unreachable(exc)
            return _FAULT

    def _adopt(self, created: Any) -> None:
        """Send to the id the server gave the run: it differs from ours only when another project had
        our id already (the server never lets one project squat another's ids)."""
        features = created.get("wire_features") if isinstance(created, dict) else None
        self._packed = isinstance(features, list) and VALUES_F64 in features
        self._packed_steps = self._packed and isinstance(features, list) and STEPS_I64 in features
        given = created.get("id") if isinstance(created, dict) else None
        if isinstance(given, str) and given and given != self.run_id:
            logger.warning(
                "gradwatch: run id %s is another project's on the server; this run is stored as %s",
                self.run_id,
                given,
            )
            self.run_id = given
            if self.on_renamed is not None:
                self.on_renamed(given)

    def _where(self) -> str:
        return f"the spool file {self.spool.path}" if self.spool.writable else "memory"

    def _warn_unreachable(self, exc: BaseException) -> None:
        if not self._failing:  # once per outage
            logger.warning(
                "gradwatch: run %s: cannot reach the server (%s); data waits in %s and is retried "
                "with backoff",
                self.run_id,
                exc,
                self._where(),
            )

    def _warn_superseded(self, step: Any) -> None:
        """The server cut a batch: another process resumed this run's rank at `step` (once per run)."""
        if self._superseded_warned:
            return
        self._superseded_warned = True
        logger.warning(
            "gradwatch: run %s rank %s was resumed by another process at step %s: the server keeps this "
            "process's data before that step only. If that resume was not yours, the project's ingest "
            "token is in other hands: revoke it and make a new one.",
            self.run_id,
            self.rank,
            step,
        )

    def _warn_auth(self, exc: BaseException) -> None:
        """A token problem is the user's to fix, not the batch's: nothing is dropped for it."""
        if not self._failing:  # once per outage
            path = self.spool.path if self.spool.writable else None
            logger.warning(
                "gradwatch: run %s: the server refused the token (%s); data waits in %s and is retried; "
                "set GRADWATCH_TOKEN (or init(token=)) to an ingest token of project %r%s",
                self.run_id,
                exc,
                self._where(),
                self.run_document.get("project"),
                f", or upload it later with `gradwatch sync {path} --token TOKEN`" if path else "",
            )

    # -- helpers ----------------------------------------------------------------------------------

    def _error(self, exc: BaseException, where: str) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("gradwatch: internal error in the %s: %s", where, exc, exc_info=exc)

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
