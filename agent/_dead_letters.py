"""What becomes of a batch the server will not take: its tries, when it is dead-lettered, the file it
goes to and the notice that tells the server. The Sender calls this under its lock; no thread here.

What a failure means for the batch (HTTP status of the answer):
    no answer, 408, 429, 502, 503, 504   the server is away or busy: retried without end (finish()
                                         stops when nothing moves, see Sender.close())
    404                                  the server lost the run: created again, retried
    401, 403                             the token is wrong for this run: retried without end, never
                                         dropped or dead-lettered -- the batches wait in the spool
                                         for a fixed token (a resumed run, or `gradwatch sync --token`)
    413                                  too large for this server: split in two by steps (the pieces
                                         take its place in the queue); a single step is dead-lettered
    other 4xx                            this batch is refused: dead-lettered after REFUSAL_TRIES tries
    other 5xx (500...), a transport's    ambiguous -- the batch, or the whole server? After
    own exception                        SERVER_ERROR_TRIES tries in a row the sender sends a small
                                         notice batch (a "dead_letter" event): if the server stores
                                         it, the fault is the batch's and it is dead-lettered; if the
                                         notice fails too, the server is failing everything and the
                                         batch stays, its count restarted. A broken server therefore
                                         never empties the spool into dead letters.
Dead-lettering moves a batch to the dead-letter file beside the spool (RUN-rankR.dead.jsonl, written
by the spool module), counts its points in stats.dead_lettered (and the agent/dead_lettered health
key), and tells the server with a "dead_letter" event (the run page lists it); `gradwatch sync`
retries those files. Without a spool file (a custom transport without spool_dir) such a batch is
dropped and counted in stats.dropped.
"""

from __future__ import annotations

import json
from typing import Any

from ._spool import DeadLetters
from ._wire import HEALTH_PREFIX, batch_steps

__all__ = ["REFUSAL_TRIES", "SERVER_ERROR_TRIES", "BatchFaults"]

# Tries of one batch before it is dead-lettered: answers 5xx (other than 502/503/504) in a row (then
# the notice probe decides), or refusals with a 4xx that is not auth/408/429.
SERVER_ERROR_TRIES = 6
REFUSAL_TRIES = 3


class BatchFaults:
    """The failures of the batch being tried, the notices queued, and the dead-lettered batches."""

    def __init__(
        self,
        dead_letters: DeadLetters | None,
        server_error_tries: int = SERVER_ERROR_TRIES,
        refusal_tries: int = REFUSAL_TRIES,
    ) -> None:
        if server_error_tries < 1 or refusal_tries < 1:
            raise ValueError(
                f"server_error_tries and refusal_tries must be >= 1, got {server_error_tries!r}, "
                f"{refusal_tries!r}"
            )
        self.file = dead_letters  # None: no spool file, a dead-lettered batch is dropped
        self.server_error_tries = server_error_tries
        self.refusal_tries = refusal_tries
        self._trying = (-1, 0, 0)  # (seq, server errors, refusals in a row) of the batch being tried
        self.notices: set[int] = set()  # seqs of queued "dead_letter" notice batches
        self.points = self.batches = 0  # dead-lettered (kept in the file)
        self.last_refusal: str | None = None  # why the latest dead-lettered batch was refused

    def failed(self, seq: int, server_error: bool, refused: bool) -> tuple[bool, bool]:
        """Count a failed try of batch `seq`: (refused for good: dead-letter it, server errors long
        enough in a row: probe with a notice)."""
        tried, errors, refusals = self._trying
        if tried != seq:
            errors = refusals = 0
        errors += server_error
        refusals += refused
        self._trying = (seq, errors, refusals)
        return refusals >= self.refusal_tries, errors >= self.server_error_tries

    def restart(self, seq: int = -1) -> None:
        """The batch `seq` starts its count again (-1: no batch is being tried)."""
        self._trying = (seq, 0, 0)

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
