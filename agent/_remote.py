"""The run as the server knows it, for the sender's uploader thread: one try of a batch at a time.

The run is created before its first batch (and again after a 404: the server lost it), batches go to
the id the server gave it (another project's id is never squatted) in the encodings it said it reads,
and a failed try comes back as what it means, gradwatch._delivery.classify's verdict; the first
failure of an outage is reported once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._delivery import Kind, Verdict, classify
from ._spool import Spool
from ._transport import Transport, TransportError
from ._wire import STEPS_I64, VALUES_F64

__all__ = ["RemoteRun"]

logger = logging.getLogger("gradwatch")


class RemoteRun:
    """One run and rank on the server, reached through `transport`."""

    def __init__(
        self,
        transport: Transport | None,
        run_document: dict[str, Any],
        rank: int,
        renamed: Callable[[str], None] | None = None,
    ) -> None:
        """renamed: told the id the server stores the run under, when it is not ours (a squatted id)."""
        self.transport = transport
        self.run_document = run_document
        self.run_id: str = run_document["id"]  # the server's id for the run (see adopt)
        self.rank = rank
        self.created = False
        self.packed = False  # the server reads values_f64 (it said so when the run was created)
        self.packed_steps = False  # ... and steps_i64
        self.renamed = renamed
        self._superseded_warned = False  # a resume by another process cut our data (said once)
        self._second_writer_warned = False  # ... and we still write the rank long after (said once)
        # The guard's (gradwatch._guard): told the run's open incidents each acknowledgement carries.
        self.on_incidents: Callable[[list[Any]], None] | None = None

    def ask_for_incidents(self, receive: Callable[[list[Any]], None]) -> None:
        """Have each batch's acknowledgement carry the run's open incidents, handed to `receive` (on the
        uploader thread). A transport of the user's own is asked through its `ask_incidents` flag."""
        self.on_incidents = receive
        if self.transport is not None:
            self.transport.ask_incidents = True  # type: ignore[attr-defined]

    def create_early(self) -> None:
        """Create the run on the server before the first batch is sealed: the run shows from the start,
        and its answer says which batch encodings the server reads (values_f64, steps_i64), which
        batches sealed afterwards use. A failure is left to the first batch's attempt, which retries
        and reports it."""
        if self.transport is None or self.created:
            return
        try:
            self.adopt(self.transport.create_run(self.run_document))
            self.created = True
        except Exception:
            logger.debug("gradwatch: run %s: creating it early failed", self.run_id, exc_info=True)

    def attempt(
        self, batch: dict[str, Any] | bytes, spool: Spool, *, failing: bool
    ) -> tuple[Verdict | None, float | None, str]:
        """One request: (None, None, "") when the server stored the batch, else what the failure means
        (classify), the wait the server asked for (Retry-After, seconds) and the error's message.
        failing: an outage was reported already, else this failure reports it (saying where the
        data waits: the spool file, or memory)."""
        assert self.transport is not None
        try:
            if not self.created:
                self.adopt(self.transport.create_run(self.run_document))
                self.created = True
            if isinstance(batch, bytes):
                send_encoded = getattr(self.transport, "send_encoded", None)
                if send_encoded is not None:
                    ack = send_encoded(self.run_id, batch)
                else:
                    ack = self.transport.send_batch(self.run_id, json.loads(batch))
            else:
                ack = self.transport.send_batch(self.run_id, batch)
            if isinstance(ack, dict) and ack.get("superseded_from") is not None:
                self._warn_superseded(ack["superseded_from"], ack.get("second_writer") is True)
            if (
                self.on_incidents is not None
                and isinstance(ack, dict)
                and isinstance(ack.get("incidents"), list)
            ):
                self.on_incidents(ack["incidents"])
            return None, None, ""
        except Exception as exc:  # noqa: BLE001 - a custom transport's own failure: try again later
            if isinstance(exc, TransportError):
                message = str(exc)
                verdict, retry_after = classify(exc.status, retryable=exc.retryable), exc.retry_after
            else:
                message = f"{type(exc).__name__}: {exc}"
                verdict, retry_after = classify(None, transport_error=False), None
            if verdict.kind is Kind.LOST_RUN:
                self.created = False  # the server lost the run (a new database): create it again
            if not failing:  # reported once per outage
                self._report(verdict, exc, spool.path if spool.writable else None)
            return verdict, retry_after, message

    def adopt(self, created: Any) -> None:
        """Send to the id the server gave the run: it differs from ours only when another project had
        our id already and our token sees every project (or the server is open, or older than run ids
        of a project's own), which names runs by the ids they are stored under."""
        features = created.get("wire_features") if isinstance(created, dict) else None
        self.packed = isinstance(features, list) and VALUES_F64 in features
        self.packed_steps = self.packed and isinstance(features, list) and STEPS_I64 in features
        given = created.get("id") if isinstance(created, dict) else None
        if isinstance(given, str) and given and given != self.run_id:
            logger.warning(
                "gradwatch: run id %s is another project's on the server; this run is stored as %s",
                self.run_id,
                given,
            )
            self.run_id = given
            if self.renamed is not None:
                self.renamed(given)

    def _warn_superseded(self, step: Any, second_writer: bool) -> None:
        """The server cut a batch: another process resumed this run's rank at `step` (said once), and
        with `second_writer`, this process still writes the rank long after (said once more)."""
        if not self._superseded_warned:
            self._superseded_warned = True
            logger.warning(
                "gradwatch: run %s rank %s was resumed by another process at step %s: from that step on "
                "the server keeps this process's data aside (an attempt of the run, GET "
                ".../attempts) rather than in the run. If that resume was not yours, the project's ingest "
                "token is in other hands: revoke it and make a new one; an admin can restore the attempt.",
                self.run_id,
                self.rank,
                step,
            )
        if second_writer and not self._second_writer_warned:
            self._second_writer_warned = True
            logger.warning(
                "gradwatch: run %s rank %s is written by two processes: another one resumed it at step %s "
                "while this one still trains. Both are kept; give each job its own run id.",
                self.run_id,
                self.rank,
                step,
            )

    def _report(self, verdict: Verdict, exc: BaseException, spool_path: Path | None) -> None:
        """The first failure of an outage. A token problem is the user's to fix, not the batch's:
        nothing is dropped for it."""
        where = f"the spool file {spool_path}" if spool_path is not None else "memory"
        if verdict.kind is Kind.AUTH:
            logger.warning(
                "gradwatch: run %s: the server refused the token (%s); data waits in %s and is retried; "
                "set GRADWATCH_TOKEN (or init(token=)) to an ingest token of project %r%s",
                self.run_id,
                exc,
                where,
                self.run_document.get("project"),
                f", or upload it later with `gradwatch sync {spool_path} --token TOKEN`"
                if spool_path
                else "",
            )
        elif verdict.waits or verdict.kind is Kind.SERVER_ERROR:
            logger.warning(
                "gradwatch: run %s: cannot reach the server (%s); data waits in %s and is retried "
                "with backoff",
                self.run_id,
                exc,
                where,
            )
