"""The sender thread: the training thread only enqueues; one worker resolves and posts batches.

The worker waits on the queue; a sentinel stops it after everything queued before it; `close()` is
idempotent. Enqueueing never blocks: a full queue drops the packet and counts it (never silently).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from ._buffer import Packet, Resolved
from ._transport import Transport, TransportError

logger = logging.getLogger("gradwatch")
_STOP = object()


@dataclass
class SenderStats:
    """The agent's own health, as counts of points."""

    queued_packets: int = 0
    sent_points: int = 0
    dropped_points: int = 0
    sent_batches: int = 0
    last_error: str | None = None


def to_batch(resolved: Resolved, rank: int, seq: int, status: str | None) -> dict[str, Any]:
    """The wire document of one batch: identity (rank, seq), data fields, and the run status."""
    batch: dict[str, Any] = {"rank": rank, "seq": seq, **resolved.wire_fields()}
    if status is not None:
        batch["status"] = status
    return batch


class Sender:
    def __init__(
        self,
        transport: Transport,
        run_document: dict[str, Any],
        rank: int,
        max_queue: int = 256,
        max_backoff: float = 30.0,
    ) -> None:
        self.transport = transport
        self.run_document = run_document
        self.rank = rank
        self.stats = SenderStats()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._max_backoff = max_backoff
        self._seq = 0
        self._run_created = False
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._closed = False
        self._warned_drop = False
        self._thread = threading.Thread(target=self._loop, name="gradwatch-sender", daemon=True)
        self._thread.start()

    def submit(self, packet: Packet) -> bool:
        """Enqueue without waiting; False (and the points counted as dropped) when the queue is full."""
        try:
            self._queue.put_nowait(packet)
            self.stats.queued_packets += 1
            return True
        except queue.Full:
            self.stats.dropped_points += len(packet.slots) + len(packet.host_scalars)
            if not self._warned_drop:
                self._warned_drop = True
                logger.warning("gradwatch: send queue full (server slow or down); dropping data")
            return False

    def close(self, timeout: float) -> bool:
        """Send what is queued, for at most `timeout` seconds; True when everything went out."""
        if self._closed:
            return True
        self._closed = True
        self._deadline = time.monotonic() + timeout
        self._closing.set()
        try:
            self._queue.put(_STOP, timeout=max(timeout, 0.0))
        except queue.Full:
            pass
        self._thread.join(timeout=max(self._deadline - time.monotonic(), 0.0) + 0.5)
        return not self._thread.is_alive() and self._queue.empty()

    # -- worker -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self._deliver(item)
            except Exception as exc:  # noqa: BLE001 - the worker must not die silently
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("gradwatch: could not send a batch: %s", exc, exc_info=exc)
            finally:
                self.stats.queued_packets -= 1

    def _deliver(self, packet: Packet) -> None:
        resolved = packet.resolve()
        batch = to_batch(resolved, self.rank, self._seq, packet.status)
        self._seq += 1
        points = sum(len(s["steps"]) for s in batch["scalars"])
        if self._with_retries(lambda: self._send(batch)):
            self.stats.sent_points += points
            self.stats.sent_batches += 1
        else:
            self.stats.dropped_points += points

    def _send(self, batch: dict[str, Any]) -> None:
        if not self._run_created:
            self.transport.create_run(self.run_document)
            self._run_created = True
        self.transport.send_batch(self.run_document["id"], batch)

    def _with_retries(self, attempt: Any) -> bool:
        delay = 0.25
        while True:
            try:
                attempt()
                return True
            except TransportError as exc:
                self.stats.last_error = str(exc)
                if not exc.retryable:
                    logger.warning("gradwatch: server refused a batch: %s", exc)
                    return False
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Exponential backoff with jitter; a close() shortens the wait to its deadline.
            wait = min(delay * random.uniform(0.5, 1.5), remaining)
            if self._closing.is_set():
                time.sleep(wait)
            else:
                self._closing.wait(wait)
            delay = min(delay * 2, self._max_backoff)
