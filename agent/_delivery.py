"""The life cycle of the sender's batches, as a pure state machine: plain data in, decisions out.

No threads, no clock (an event that needs the time is given `now`, seconds on any monotonic clock),
no I/O. gradwatch._sender's two threads feed a Delivery their events under the sender's lock and
carry out what it decides (seal, spool, send, split, dead-letter, wait); the tests drive it alone.

    pending ──seal──▶ sealed ──send──▶ in flight ──2xx──────────────────────────▶ stored
                       ▲   │                      ├─ 413 ──────────────────────▶ split: two sealed
                       │   │ the server fails:    │                               halves in its place
                       │   ▼ written to the file  ├─ refused REFUSAL_TRIES times,
                       │ spooled                  │  or a probe stored ─────────▶ dead-lettered: a
                       │                          │                               sealed notice in
                       └──────── retried ◀────────┘  any other failure            its place

pending       fragments (one per flush) not sealed yet; merged while the uploader is busy.
sealed        a batch with its seq, queued oldest first (the spool holds it, in memory).
spooled       a sealed batch also written to the spool file: every batch while the server is
              failing (`failing`), and whatever is left at close.
in flight     the batch one try is sending now: the oldest queued.
stored        the server has it: it leaves the queue, `failing` ends, the backoff restarts.
split         413: two halves by steps take its place (a single step cannot split: dead-lettered).
dead-lettered moved to the dead-letter file; a small notice batch queues in its place to tell the
              server. A notice the server will not take is dropped instead (it carries no points).
retried       back in the queue after a backoff wait (at least the server's Retry-After); while a
              batch keeps failing with server errors, a notice probes whether the fault is its own.

What each answer means is classify()'s, the one place that policy is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REFUSAL_TRIES",
    "SERVER_ERROR_TRIES",
    "Action",
    "Decision",
    "Delivery",
    "Kind",
    "Seal",
    "SenderStats",
    "Verdict",
    "classify",
    "progress_line",
]

# Tries of one batch before it is dead-lettered: answers 5xx (other than 502/503/504) in a row (then
# the notice probe decides), or refusals with a 4xx that is not auth/408/429.
SERVER_ERROR_TRIES = 6
REFUSAL_TRIES = 3

_UNAVAILABLE = frozenset({408, 429, 502, 503, 504})  # the server (or its proxy) is away or busy
_AUTH = frozenset({401, 403})
_RETRY_AFTER = frozenset({429, 503})  # the answers whose Retry-After header is honoured


class Kind(enum.Enum):
    """What a failed try says about the batch (see classify)."""

    UNAVAILABLE = "unavailable"
    LOST_RUN = "lost run"
    AUTH = "auth"
    TOO_LARGE = "too large"
    SERVER_ERROR = "server error"
    REFUSED = "refused"


@dataclass(frozen=True)
class Verdict:
    """classify()'s answer. retryable: the failure is the server's trouble, not the request's, so
    the same request can succeed later unchanged (TransportError.retryable; `gradwatch sync` gives up
    on a batch that is not). honours_retry_after: the answer's Retry-After header is a wait to keep."""

    kind: Kind
    retryable: bool
    honours_retry_after: bool = False

    @property
    def waits(self) -> bool:
        """Not the batch's fault: it waits (without end) for the server, the run or the token."""
        return self.kind in (Kind.UNAVAILABLE, Kind.LOST_RUN, Kind.AUTH)


def classify(status: int | None, *, retryable: bool = True, transport_error: bool = True) -> Verdict:
    """What a failed try means, from the HTTP status of the answer (None: no answer).

    `retryable` matters only without a status: the transport's word on whether the request can
    succeed later (TransportError.retryable). transport_error=False: a custom transport raised an
    exception of its own (not a TransportError).

        no answer (retryable),               UNAVAILABLE: the server is away or busy -- retried
        408, 429, 502, 503, 504              without end (finish() stops when nothing moves, see
                                             Sender.close()); 429 and 503's Retry-After (seconds,
                                             at most MAX_RETRY_AFTER) is waited when longer than
                                             the backoff
        404                                  LOST_RUN: the server lost the run -- created again,
                                             retried
        401, 403                             AUTH: the token is wrong for this run -- retried
                                             without end, never dropped or dead-lettered: the
                                             batches wait in the spool for a fixed token (a resumed
                                             run, or `gradwatch sync --token`)
        413                                  TOO_LARGE: too large for this server -- split in two by
                                             steps (the halves take its place in the queue); a
                                             single step is dead-lettered
        other 4xx (and 3xx), a no-answer     REFUSED: this batch is refused -- dead-lettered after
        failure that is not retryable        REFUSAL_TRIES tries in a row
        other 5xx (500...), a custom         SERVER_ERROR: ambiguous, the batch or the whole server?
        transport's own exception            After SERVER_ERROR_TRIES tries in a row the sender
                                             sends a small notice batch (a "dead_letter" event): if
                                             the server stores it, the fault is the batch's and it
                                             is dead-lettered; if the notice fails too, the server
                                             is failing everything and the batch stays, its count
                                             restarted. A broken server never empties the spool
                                             into dead letters.

    retryable (TransportError's, for an answer): 5xx, 408 and 429 are the server's trouble; every
    other status says this request is wrong as it is.
    """
    if not transport_error:
        return Verdict(Kind.SERVER_ERROR, retryable=True)
    if status is None:
        return Verdict(Kind.UNAVAILABLE if retryable else Kind.REFUSED, retryable)
    if status in _AUTH:
        kind = Kind.AUTH
    elif status == 413:
        kind = Kind.TOO_LARGE
    elif status in _UNAVAILABLE:
        kind = Kind.UNAVAILABLE
    elif status == 404:
        kind = Kind.LOST_RUN
    elif status >= 500:
        kind = Kind.SERVER_ERROR
    else:
        kind = Kind.REFUSED
    return Verdict(kind, status >= 500 or status in (408, 429), status in _RETRY_AFTER)


def progress_line(
    run_id: str, done: int, left: int, quiet: float | None, stall_timeout: float, why: str | None
) -> str | None:
    """close()'s line while a backlog uploads: `done` points of done + `left` are uploaded; `quiet`:
    seconds the server has taken nothing, when that is long enough to say (with `why`, the latest
    failure); None when no points are left (only notices or a last request in flight)."""
    if not left:
        return None
    total = done + left
    line = f"gradwatch: run {run_id}: uploading {total:,} points, {100 * done // total}%"
    if quiet is not None:
        line += (
            f"; the server has taken nothing for {quiet:.0f} s"
            + (f" ({why})" if why else "")
            + f"; giving up after {stall_timeout:.0f} s"
        )
    return line


class Action(enum.Enum):
    """What becomes of the batch after a failed try."""

    RETRY = "retry"  # back in the queue; wait first
    PROBE = "probe"  # send a notice to learn whose fault the server errors are; wait if it fails
    SPLIT = "split"  # replace it by two halves (a single step: dead-letter it instead)
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True)
class Decision:
    """What the sender does about a failed try. spool: the server has started failing, write the
    queue to the spool file now. backoff: the failure counts toward the backoff; wait
    max(backoff, at_least) seconds (at_least: the server's Retry-After) unless the action ends the
    batch. reason: the reason to record when the failure left no message."""

    action: Action
    spool: bool = False
    backoff: bool = False
    at_least: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Seal:
    """Seal the pending fragments now; persist: write the batches to the spool file at once."""

    persist: bool


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


class Delivery:
    """The state of one sender's batches (see the module docstring) and the decisions it makes."""

    def __init__(
        self,
        *,
        online: bool = True,
        spill_after: float = 1.0,
        max_batch_points: int = 50_000,
        server_error_tries: int = SERVER_ERROR_TRIES,
        refusal_tries: int = REFUSAL_TRIES,
        now: float = 0.0,
    ) -> None:
        """online: there is a server (else batches only go to the spool file); spill_after: seconds
        pending data waits before it is sealed while there is a backlog; max_batch_points: pending
        points sealed at once; server_error_tries / refusal_tries: see classify(); now: the time."""
        if server_error_tries < 1 or refusal_tries < 1:
            raise ValueError(
                f"server_error_tries and refusal_tries must be >= 1, got {server_error_tries!r}, "
                f"{refusal_tries!r}"
            )
        self.online = online
        self.spill_after = spill_after
        self.max_batch_points = max_batch_points
        self.server_error_tries = server_error_tries
        self.refusal_tries = refusal_tries
        self.pending: list[dict[str, Any]] = []  # fragments not sealed yet
        self.pending_points = 0
        self.pending_since = 0.0  # when the oldest pending fragment came
        self.sealed_at: float | None = None  # when a batch was last sealed (None: never yet)
        self.final_counters_sealed = False  # a closing run's last batch: its final health counters
        self.failing = False  # the last try failed and is retried: batches are spooled
        self.in_flight: int | None = None  # the seq being sent
        self.notices: set[int] = set()  # seqs of queued "dead_letter" notices
        self.sent_points = self.sent_batches = 0
        self.progress_at = now  # the last time something moved (a packet taken, a batch done)
        self._trying = (-1, 0, 0)  # (seq, server errors, refusals in a row) of the batch being tried

    # -- pending -> sealed (the collector, and the uploader when it has nothing queued) -------------

    def moved(self, now: float) -> None:
        """Something moved: a packet left the inbox (or close() starts counting how long nothing does)."""
        self.progress_at = now

    def add(self, fragment: dict[str, Any], points: int, now: float) -> None:
        """A flush's fragment is pending."""
        if not self.pending:
            self.pending_since = now
        self.pending.append(fragment)
        self.pending_points += points

    def seal_due(self, now: float, *, queued: int, closing: bool, released: bool = True) -> Seal | None:
        """The collector's look: seal pending data when it must not wait for the uploader -- it is a
        full batch, or it aged spill_after behind a backlog (or offline), or an offline run closes.
        queued: batches in the queue; released: the run's id and rank are settled."""
        if not self.pending or not released:
            return None
        offline = not self.online
        backlog = self.failing or queued > 0
        aged = now - self.pending_since >= self.spill_after
        big = self.pending_points >= self.max_batch_points
        if (closing and offline) or big or (aged and (offline or backlog)):
            return Seal(persist=offline or self.failing)
        return None

    def seal_to_send(self, *, queued: int, collector_done: bool) -> Seal | None:
        """The uploader's look, with nothing queued: seal what is pending to send it now. While the
        server fails, pending data waits to be merged (the collector seals it after spill_after);
        with the collector done, nobody else will."""
        if queued or not self.pending or (self.failing and not collector_done):
            return None
        return Seal(persist=self.failing)

    def seal(self, now: float) -> list[dict[str, Any]]:
        """pending -> sealed: the fragments to seal into batches (each gets its seq once)."""
        fragments, self.pending, self.pending_points = self.pending, [], 0
        self.sealed_at = now
        return fragments

    def keep_alive_due(self, now: float, interval: float, *, queued: int, released: bool = True) -> bool:
        """Whether a run that has sent before and had nothing to send for `interval` seconds seals a
        sign of life (its health counters, no data); then seal(now)."""
        return (
            self.online
            and self.sealed_at is not None
            and not self.pending
            and not queued
            and released
            and now - self.sealed_at >= interval
        )

    def final_counters_due(self, *, closing: bool, collector_done: bool, queued: int) -> bool:
        """Whether a closing online run, every batch of it stored, seals its final health counters (no
        data) now; once. Each batch carries the counters as they stood when it was sealed, before it
        was sent: without this the run's last agent/sent would leave out its last batch."""
        due = (
            self.online
            and closing
            and collector_done
            and self.sealed_at is not None
            and not self.pending
            and not queued
            and not self.final_counters_sealed
        )
        if due:
            self.final_counters_sealed = True
        return due

    # -- sealed -> in flight -> stored | split | dead-lettered | retried (the uploader) -------------

    def sending(self, seq: int) -> None:
        """sealed -> in flight."""
        self.in_flight = seq

    def stored(self, seq: int, points: int, now: float) -> bool:
        """in flight -> stored. True when this ends an outage (the server is back)."""
        recovered = self.failing
        self.in_flight = None
        self.notices.discard(seq)
        self.sent_points += points
        self.sent_batches += 1
        self.failing = False
        self._done(now)
        return recovered

    def failed(self, seq: int, verdict: Verdict, retry_after: float | None = None) -> Decision:
        """in flight -> split | dead-lettered | retried: what to do about a failed try of `seq`."""
        self.in_flight = None
        tried, errors, refusals = self._trying
        if tried != seq:
            errors = refusals = 0
        errors += verdict.kind is Kind.SERVER_ERROR
        refusals += verdict.kind is Kind.REFUSED
        self._trying = (seq, errors, refusals)
        if verdict.kind is Kind.TOO_LARGE:
            return Decision(Action.SPLIT, reason="HTTP 413")
        if refusals >= self.refusal_tries:
            return Decision(Action.DEAD_LETTER, reason="refused")
        spool = not self.failing
        self.failing = True
        probe = errors >= self.server_error_tries
        if probe and seq in self.notices:  # a notice failing itself proves nothing: it is dropped
            action = Action.DEAD_LETTER
        else:
            action = Action.PROBE if probe else Action.RETRY
        return Decision(action, spool, backoff=True, at_least=retry_after or 0.0, reason="server error")

    def probed(self, seq: int, stored: bool) -> Decision:
        """The notice a PROBE sent for `seq` was stored (the server takes other batches: the fault is
        this one's, dead-letter it) or not (the server fails everything: `seq` stays, its count
        restarts, and the wait goes on)."""
        if not stored:
            self._trying = (seq, 0, 0)
            return Decision(Action.RETRY)
        self.sent_batches += 1
        self.failing = False
        return Decision(Action.DEAD_LETTER)

    def split(self, now: float) -> None:
        """in flight -> split (the halves were queued in its place)."""
        self._done(now)

    def dead_lettered(self, seq: int, now: float) -> bool:
        """in flight -> dead-lettered. True when `seq` is a notice: it is only removed (it carries no
        points); else the batch goes to the dead-letter file and a notice (notice_queued) takes
        its place."""
        self._done(now)
        if seq in self.notices:
            self.notices.discard(seq)
            return True
        return False

    def notice_queued(self, seq: int) -> None:
        """A "dead_letter" notice with seq `seq` is sealed."""
        self.notices.add(seq)

    def _done(self, now: float) -> None:
        """A batch left the in-flight state for good (stored, split, dead-lettered): the next try of
        any batch starts its count anew."""
        self._trying = (-1, 0, 0)
        self.progress_at = now
