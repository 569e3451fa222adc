"""What becomes of a batch the server will not take as it is: split in two (413), or moved to the
dead-letter file with a notice that tells the server; and the counts. When that happens is
gradwatch._delivery's to decide (its classify() is the status policy); this module carries it out on
the spool and the dead-letter file. The Sender calls it under its lock; no thread here.

Dead-lettering moves a batch to the dead-letter file beside the spool (RUN-rankR.dead.jsonl, written
by the spool module), counts its points in stats.dead_lettered (and the agent/dead_lettered health
key), and tells the server with a "dead_letter" event (the run page lists it); `gradwatch sync`
retries those files. Without a spool file (a custom transport without spool_dir) such a batch is
dropped and counted in stats.dropped.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ._delivery import REFUSAL_TRIES, SERVER_ERROR_TRIES, Delivery
from ._spool import DeadLetters, Spool
from ._wire import HEALTH_PREFIX, SeqAllocator, batch_steps, dumps, halve_batch

__all__ = ["REFUSAL_TRIES", "SERVER_ERROR_TRIES", "BatchFaults"]

logger = logging.getLogger("gradwatch")


class BatchFaults:
    """Carries out the Delivery's decisions about a batch the server will not take as it is: split
    in two, or dead-lettered with a notice in its place; keeps the dead-letter counts."""

    def __init__(
        self, dead_letters: DeadLetters | None, spool: Spool, delivery: Delivery, seqs: SeqAllocator
    ) -> None:
        self.file = dead_letters  # None: no spool file, a dead-lettered batch is dropped
        self.spool = spool
        self.delivery = delivery
        self.seqs = seqs
        self.points = self.batches = 0  # dead-lettered (kept in the file)
        self.last_refusal: str | None = None  # why the latest dead-lettered batch was refused
        self._warned: set[str] = set()  # "kept", "dropped": said once each

    def split(
        self, seq: int, batch: dict[str, Any] | bytes, rank: int, run_id: str, error: str | None, now: float
    ) -> bool:
        """Replace a batch the server found too large (413) by two halves, queued in its place;
        False when it holds a single step."""
        pieces = halve_batch(batch, rank, self.seqs.next)
        if pieces is None:
            return False
        self.spool.replace(seq, pieces)
        self.delivery.split(now)
        logger.info(
            "gradwatch: run %s: the server found batch %d too large (%s); sending it in two halves",
            run_id,
            seq,
            error,
        )
        return True

    def dead_letter(
        self,
        seq: int,
        batch: dict[str, Any] | bytes,
        points: int,
        reason: str,
        *,
        run_id: str,
        rank: int,
        newest_step: int,
        now: float,
        notice_sent: bool = False,
    ) -> int:
        """Move a batch the server will not take out of the queue, to the dead-letter file; unless
        it went out already (the probe), queue a notice for the server at its place. Returns the
        points dropped (there is no file to keep them)."""
        if self.delivery.dead_lettered(seq, now):
            self.spool.remove(seq)  # a notice the server will not take: it carries no points
            return 0
        order = self.spool.order_of(seq)
        kept = self.keep(seq, batch if isinstance(batch, bytes) else dumps(batch).encode(), points, reason)
        self.spool.retire(seq, "dead_letter")
        where = self.file.path if self.file is not None else None
        if kept and "kept" not in self._warned:
            logger.warning(
                "gradwatch: run %s: the server would not take a batch of %d points (%s); it is moved to "
                "%s so the batches after it go on (counted in run.stats.dead_lettered); "
                "`gradwatch sync %s` retries it",
                run_id,
                points,
                reason,
                where,
                where,
            )
        elif not kept and "dropped" not in self._warned:
            logger.warning(
                "gradwatch: run %s: the server would not take a batch of %d points (%s) and there is no "
                "dead-letter file to keep it in; dropped, counted in run.stats.dropped",
                run_id,
                points,
                reason,
            )
        self._warned.add("kept" if kept else "dropped")
        if not notice_sent:
            notice = self.notice(
                rank, self.seqs.next(), seq, batch, points, reason, newest_step, counted=True
            )
            self.delivery.notice_queued(notice["seq"])
            self.spool.add(notice, 0, persist=self.delivery.failing, order=order)
        return 0 if kept else points

    def keep(self, seq: int, body: bytes, points: int, reason: str) -> bool:
        """Write a batch the server will not take to the dead-letter file and count it; False when
        there is no file (or it cannot be written): the caller drops and counts it."""
        self.last_refusal = reason
        kept = self.file is not None and self.file.add(seq, body, points, reason)
        if kept:
            self.points += points
            self.batches += 1
        return kept

    def notice(
        self,
        rank: int,
        notice_seq: int,
        seq: int,
        batch: dict[str, Any] | bytes,
        points: int,
        reason: str,
        newest_step: int,
        counted: bool,
    ) -> dict[str, Any]:
        """A small batch (seq `notice_seq`) telling the server about dead-lettered batch `seq`: a
        "dead_letter" event at its first step and agent/dead_lettered at its last. counted: the batch
        is in the counts already (else it is about to be: the probe's notice)."""
        try:
            data = json.loads(batch) if isinstance(batch, bytes) else batch
            steps = sorted(batch_steps(data))
        except (ValueError, KeyError, TypeError):
            steps = []
        first, last = (steps[0], steps[-1]) if steps else (newest_step, newest_step)
        dead_batches, dead_points = (
            (self.batches, self.points) if counted else (self.batches + 1, self.points + points)
        )
        where = str(self.file.path) if self.file is not None else None
        details: dict[str, Any] = {
            "seq": seq,
            "points": points,
            "first_step": first,
            "last_step": last,
            "reason": reason[:500],
            "dead_lettered_batches": dead_batches,
            "dead_lettered_points": dead_points,
            "file": where,
            "hint": f"retry with `gradwatch sync {where}`" if where else "dropped: the run has no spool file",
        }
        return {
            "rank": rank,
            "seq": notice_seq,
            "scalars": [
                {"key": f"{HEALTH_PREFIX}dead_lettered", "steps": [last], "values": [float(dead_points)]}
            ],
            "events": [{"step": first, "kind": "dead_letter", "data": details}],
        }
