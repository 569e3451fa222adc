"""What Run.finish() tells the user once the sender has closed: where an offline run's points were
written, why a run ended with data the server has not taken (and where it waits), which batches went
to the dead-letter file, and how many points were dropped. Kept apart from _run because it is all
wording about the outcome, read by people, while _run holds the run's own bookkeeping; finish() hands
it the closed sender and the limits it closed under."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._sender import Sender

logger = logging.getLogger("gradwatch")


def report_finish(
    run_id: str,
    mode: str,
    sender: Sender,
    everything_sent: bool,
    timeout: float | None,
    stall_timeout: float,
) -> None:
    """Log how the run's data ended up once `sender` has closed (see Run.finish): `everything_sent` is
    what sender.close(timeout, stall_timeout) returned."""
    stats, path = sender.stats, sender.spool.path
    if mode == "offline":
        logger.info(
            "gradwatch: run %s: %d points written to %s; upload them with `gradwatch sync %s`",
            run_id,
            stats.spooled,
            path,
            path,
        )
    elif not everything_sent:
        where = (
            (
                f"{stats.spooled} points wait in {path} (sent when this run resumes, or with "
                f"`gradwatch sync {path}`)"
            )
            if stats.spooled
            else ""
        )
        lost = f"{stats.queued} points held in memory are lost" if stats.queued else ""
        failing = sender.failing_reason
        if sender.close_reason == "timeout":
            why = f"finish(timeout={timeout:g}) ran out " + (
                f"while the server was failing ({failing})"
                if failing
                else "while the server was still taking data"
            )
        elif sender.close_reason == "stalled":
            why = f"the server took nothing for {stall_timeout:g} s ({failing or 'no answer'})"
        else:
            why = "the server did not take everything" + (f" ({failing})" if failing else "")
        left = "; ".join(x for x in (where, lost) if x) or "a last request was still in flight"
        logger.warning("gradwatch: run %s: %s: %s", run_id, why, left)
    if stats.dead_lettered_batches and sender.dead_letter_file is not None:
        dead = sender.dead_letter_file
        logger.warning(
            "gradwatch: run %s: %d batches (%d points) the server would not take are in %s "
            "(last refusal: %s); `gradwatch sync %s` retries them",
            run_id,
            stats.dead_lettered_batches,
            stats.dead_lettered,
            dead,
            sender.last_refusal,
            dead,
        )
    if stats.dropped:
        logger.warning(
            "gradwatch: run %s: %d points were dropped%s",
            run_id,
            stats.dropped,
            f" (last error: {stats.last_error})" if stats.last_error else "",
        )
