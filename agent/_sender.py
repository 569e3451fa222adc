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

Both threads only carry out what a gradwatch._delivery.Delivery decides: the batch life cycle
(pending, sealed, spooled, in flight, stored, split, dead-lettered, retried) is that state machine's,
and what each answer of the server means (retried, split, dead-lettered beside the spool and retried
by `gradwatch sync`) is _delivery.classify's: a broken server never empties the spool into dead
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

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._buffer import Packet
from ._dead_letters import REFUSAL_TRIES, SERVER_ERROR_TRIES, BatchFaults
from ._delivery import Action, Delivery, SenderStats, Verdict, progress_line
from ._remote import RemoteRun
from ._spool import DeadLetters, Spool, dead_letter_path
from ._text import notice
from ._transport import Backoff, HttpTransport, Transport
from ._wire import (
    HEALTH_PREFIX,
    MAX_BATCH_VALUES,
    SeqAllocator,
    batch_points,
    dumps,
    group_fragments,
    last_step,
    merge_fragments,
    pack_values,
    split_by_steps,
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
        server_error_tries / refusal_tries: see _delivery.classify; hold: the run's id and rank are
        not settled yet -- packets are taken, but nothing is sealed, spooled or sent until release()."""
        if max_queue < 1 or max_batch_points < 1:
            raise ValueError(
                f"max_queue and max_batch_points must be >= 1, got {max_queue!r}, {max_batch_points!r}"
            )
        self.transport = transport
        self.run_document = run_document
        # Told the id the server stores the run under, when it is not ours (a squatted id).
        self.on_renamed: Callable[[str], None] | None = None
        self.remote = RemoteRun(transport, run_document, rank, renamed=self._renamed)  # the uploader's
        self.spool = spool if spool is not None else Spool(None, run_document, rank)
        if dead_letters is None and self.spool.path is not None:
            dead_letters = DeadLetters(
                dead_letter_path(self.spool.path), run_document, rank, created_at=self.spool.created_at
            )
        # The batch life cycle: changed under _lock (moved() aside: one float); its counters are read
        # without.
        self._delivery = Delivery(
            online=transport is not None,
            spill_after=spill_after,
            max_batch_points=max_batch_points,
            server_error_tries=server_error_tries,
            refusal_tries=refusal_tries,
            now=time.monotonic(),
        )
        self._max_queue = max_queue
        self._poll_interval = poll_interval
        self._backoff = backoff or Backoff()
        self._seqs = SeqAllocator()
        self._faults = BatchFaults(dead_letters, self.spool, self._delivery, self._seqs)
        self._inbox: deque[tuple[Packet, int]] = deque()
        # Counters with a single writer each, so the training thread never takes a lock.
        self._submitted = 0  # training thread
        self._rejected = 0  # training thread: points of packets refused by a full inbox
        self._taken = 0  # collector
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._dropped = 0
        self._last_error: str | None = None
        self._newest_step = 0  # the largest step sealed so far (a notice about a stepless batch)
        self._ended_as: str | None = None  # the status of the last batch that carried one
        self._encoded: dict[int, bytes] = {}  # seq -> JSON of a sealed batch, encoded ahead (_encode_ahead)
        self._warned: set[str] = set()
        self._closing = threading.Event()
        self._stop = threading.Event()  # close() stopped waiting: the workers end now
        self._deadline = float("inf")
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

    @property
    def run_id(self) -> str:
        """The id batches go to: the run document's, or the server's when it gave another."""
        return self.remote.run_id

    @run_id.setter
    def run_id(self, run_id: str) -> None:
        self.remote.run_id = run_id

    @property
    def rank(self) -> int:
        return self.remote.rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self.remote.rank = rank

    def _renamed(self, run_id: str) -> None:
        if self.on_renamed is not None:
            self.on_renamed(run_id)

    # -- training thread --------------------------------------------------------------------------

    def submit(self, packet: Packet) -> bool:
        """Hand a packet to the sender without waiting; False (points counted as dropped) when full."""
        if self._forked:
            return False
        points = packet.points
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
        spool, delivery = self.spool, self._delivery
        return SenderStats(
            queued=max(self._submitted - self._taken, 0) + delivery.pending_points + spool.memory_points,
            sent=delivery.sent_points,
            spooled=spool.disk_points,
            dropped=self._rejected + self._dropped + spool.dropped_points,
            sent_batches=delivery.sent_batches,
            last_error=self._last_error,
            dead_lettered=self._faults.points,
            dead_lettered_batches=self._faults.batches,
        )

    @property
    def failing_reason(self) -> str | None:
        """The last error when the latest try failed (the server is not taking data now), else None."""
        return self._last_error if self._delivery.failing else None

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
            self._delivery.moved(started)
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
                if self._delivery.pending:
                    self._seal(persist=True)
                self.spool.persist()
                self.spool.close()  # durable, and left to `gradwatch sync`
        left = len(self.spool) if self.transport is not None else self.spool.memory_entries
        return not self._inbox and not self._delivery.pending and not left

    def _drain(self, started: float, stall_timeout: float) -> str | None:
        """close()'s wait: None when the workers are done, else why it stopped waiting."""
        done_before = self._done_points()
        worker = self._uploader or self._collector
        next_line = started + PROGRESS_EVERY
        while worker.is_alive() or self._collector.is_alive():
            now = time.monotonic()
            if now >= self._deadline:
                return "timeout"
            progress_at = self._delivery.progress_at
            idle = now - progress_at
            if idle >= stall_timeout:
                return "stalled"
            if now >= next_line:
                if self._uploader is not None:
                    self._report_progress(done_before, idle, stall_timeout)
                next_line = now + PROGRESS_EVERY
            wake = min(self._deadline, progress_at + stall_timeout, next_line)
            waiting_for = worker if worker.is_alive() else self._collector
            waiting_for.join(min(max(wake - now, 0.01), 0.25))
        return None

    def _done_points(self) -> int:
        """Points that have left the queue: stored, dead-lettered or dropped."""
        return self._delivery.sent_points + self._faults.points + self._dropped + self.spool.dropped_points

    def _report_progress(self, done_before: int, idle: float, stall_timeout: float) -> None:
        stats, done = self.stats, max(self._done_points() - done_before, 0)
        quiet = idle if idle >= PROGRESS_EVERY else None
        line = progress_line(
            self.run_id, done, stats.queued + stats.spooled, quiet, stall_timeout, self.failing_reason
        )
        if line is not None:
            notice(line)

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
                self._faults.file = DeadLetters(
                    dead_letter_path(spool_path),
                    self.run_document,
                    self.rank,
                    created_at=self.spool.created_at,
                )
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
                    released, queued = self._released.is_set(), len(self.spool)
                    seal = self._delivery.seal_due(
                        time.monotonic(), queued=queued, closing=closing, released=released
                    )
                    if seal is not None:
                        self._seal(seal.persist)
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
            fragment = packet.fragment()
        except Exception as exc:  # noqa: BLE001 - one bad packet must not stop the others
            with self._lock:
                self._dropped += points
            self._error(exc, "resolve")
            return
        finally:
            self._taken += points
            self._delivery.moved(time.monotonic())
        with self._changed:
            self._delivery.add(fragment, batch_points(fragment), time.monotonic())
            self._changed.notify_all()

    def _encode_ahead(self) -> None:
        """Encode the next sealed batches while the uploader waits for the server's answer to the one
        in flight (the JSON of 50,000 points takes tens of milliseconds): the uploader then sends
        bytes, and the agent's encoding overlaps the server's storing instead of alternating with it."""
        if self._delivery.failing or getattr(self.transport, "send_encoded", None) is None:
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

    def _seal(self, persist: bool) -> None:
        """(under _lock) Turn pending fragments into batches with their seq, and hand them to the spool."""
        fragments, limit = self._delivery.seal(time.monotonic()), self._delivery.max_batch_points
        for group in group_fragments(fragments, limit):
            for data in split_by_steps(merge_fragments(group), limit, MAX_BATCH_VALUES):
                points = batch_points(data)
                step = last_step(data)
                if self.remote.packed:
                    data = pack_values(data, steps=self.remote.packed_steps)
                batch = {"rank": self.rank, "seq": self._seqs.next(), **data}
                if batch.get("status"):
                    self._ended_as = batch["status"]  # the final counters repeat it (_seal_counters)
                self._add_health(batch, step)
                self.spool.add(batch, points, persist)  # no room at all: the spool counts it and warns once

    def _keep_alive_if_due(self) -> None:
        """(under _lock) A sign of life from a run that has sent before and has had nothing to send
        for KEEPALIVE_S: its health counters at its newest step, no other data (the server stores
        them at that step again, and the run's last-seen time moves)."""
        now = time.monotonic()
        due = self._delivery.keep_alive_due(
            now, KEEPALIVE_S, queued=len(self.spool), released=self._released.is_set()
        )
        if due:
            self._seal_counters()
            self._delivery.seal(now)

    def _seal_counters(self, final: bool = False) -> None:
        """(under _lock) The health counters alone, at the newest step; the final ones with the status."""
        batch: dict[str, Any] = {"rank": self.rank, "seq": self._seqs.next()}
        if final and self._ended_as is not None:
            batch["status"] = self._ended_as
        self._add_health(batch, self._newest_step)
        self.spool.add(batch, 0, False)

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
        self.remote.create_early()
        while True:
            try:
                if not self._upload_once():
                    return
            except Exception as exc:  # noqa: BLE001 - the worker must not die silently
                self._error(exc, "uploader")
                if self._wait(1.0):
                    return

    def _stopped(self) -> bool:
        return self._stop.is_set() or time.monotonic() >= self._deadline

    def _upload_once(self) -> bool:
        """One try of the oldest batch, and what the Delivery decides of its answer; False when the
        uploader is done (all sent, or stopped)."""
        delivery = self._delivery
        with self._changed:
            while True:
                if self._stopped():
                    return False
                seal = delivery.seal_to_send(queued=len(self.spool), collector_done=self._collector_done)
                if seal is not None:
                    self._seal(seal.persist)
                head = self.spool.oldest()
                if head is None and delivery.final_counters_due(
                    closing=self._closing.is_set(), collector_done=self._collector_done, queued=0
                ):
                    self._seal_counters(final=True)  # finish(): the run's counters as it ends, exact
                    head = self.spool.oldest()
                if head is not None:
                    break
                if self._collector_done and not delivery.pending:
                    return False
                self._changed.wait(0.5)
            seq, batch, points = head
            delivery.sending(seq)
            encoded = self._encoded.pop(seq, None)
        verdict, retry_after = self._attempt(batch if encoded is None else encoded)
        with self._lock:
            now = time.monotonic()
            if verdict is None:
                self.spool.remove(seq)
                if delivery.stored(seq, points, now):
                    logger.info(
                        "gradwatch: run %s: server reachable again; sending the %d spooled points",
                        self.run_id,
                        self.spool.points,
                    )
                self._backoff.reset()
                return True
            decision = delivery.failed(seq, verdict, retry_after)
            if decision.spool:
                self.spool.persist()
            delay = max(self._backoff.next_delay(), decision.at_least) if decision.backoff else 0.0
            reason = self._last_error or decision.reason
            if decision.action is Action.SPLIT:
                if self._faults.split(seq, batch, self.rank, self.run_id, self._last_error, now):
                    return True
                self._dead_letter(seq, batch, points, reason)  # a single step cannot be split
                return True
            if decision.action is Action.DEAD_LETTER:
                self._dead_letter(seq, batch, points, reason)
                return True
        if decision.action is Action.PROBE and self._probe(seq, batch, points, reason):
            return True
        return not self._wait(delay)

    def _probe(self, seq: int, batch: dict[str, Any] | bytes, points: int, reason: str) -> bool:
        """Batch `seq` failed with server errors SERVER_ERROR_TRIES times in a row: send the notice
        that it is dead-lettered. Stored: the fault is this batch's, it is dead-lettered (True)."""
        with self._lock:
            notice = self._faults.notice(
                self.rank, self._seqs.next(), seq, batch, points, reason, self._newest_step, counted=False
            )
        verdict, _ = self._attempt(notice)
        with self._lock:
            if self._delivery.probed(seq, stored=verdict is None).action is not Action.DEAD_LETTER:
                return False
            self._backoff.reset()
            self._dead_letter(seq, batch, points, reason, notice_sent=True)
        return True

    def _dead_letter(
        self, seq: int, batch: dict[str, Any] | bytes, points: int, reason: str, notice_sent: bool = False
    ) -> None:
        """(under _lock) BatchFaults.dead_letter, the points it drops counted."""
        self._dropped += self._faults.dead_letter(
            seq,
            batch,
            points,
            reason,
            run_id=self.run_id,
            rank=self.rank,
            newest_step=self._newest_step,
            now=time.monotonic(),
            notice_sent=notice_sent,
        )

    def _attempt(self, batch: dict[str, Any] | bytes) -> tuple[Verdict | None, float | None]:
        """One try (RemoteRun.attempt): None when stored, else the failure's verdict and Retry-After."""
        verdict, retry_after, message = self.remote.attempt(batch, self.spool, failing=self._delivery.failing)
        if verdict is not None:
            self._last_error = message
        return verdict, retry_after

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

    # -- helpers ----------------------------------------------------------------------------------

    def _error(self, exc: BaseException, where: str) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("gradwatch: internal error in the %s: %s", where, exc, exc_info=exc)

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
