"""Resuming a run from a checkpoint: gradwatch.init(run_id=<from the checkpoint>, resume=...).

Modes (wandb's words):
    "allow"  continue the run if the server has it, else start it under that id
    "must"   continue the run; init() raises ResumeError when the server answers that it has no such run
    "never"  start a new run; init() raises ResumeError when the server answers that the id exists

init() asks the server once, before training starts (it is setup code, not the training step; at most
CHECK_TIMEOUT_S). Only a definite answer raises. When the server cannot be asked (offline mode, not
reachable, a transport that cannot tell), init() goes on without raising: a resume is then assumed
for "allow" and "must" (the server records it when the data arrives), "never" starts as usual.

The step counter. A resumed run continues from its checkpoint's step, taken, in this order, from:
    run.step = N            set after init() (the checkpoint pattern: store run.id and the step)
    run.log(..., step=N)    the first log call with a step, within the first optimizer step (before
                            it: N is the current step; after it: N is the step that just ended)
    the server's last step  + 1, when init() could ask (a plain continuation: nothing is replaced)
    0                       otherwise, with a warning
Until the step is known (at most RESUME_GRACE_STEPS optimizer steps and RESUME_HOLD_MAX_ITEMS
observations) nothing is flushed, and what was recorded meanwhile -- the scaler_state_loaded event
of scaler.load_state_dict() included -- moves to the resumed numbering. The run then sends one
`resume` event at that step; the server replaces the rank's data from that step on (points of the
abandoned attempt after the checkpoint are superseded: the charts show one continuous line with the
resume marked), sets the run running again, and its alert rules start over there (a restored loss
scale is calibration, not a scale event). A run the server has no data for is not resumed: it
starts as a new one (nothing to continue).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ._errors import ResumeError
from ._transport import HttpTransport, Transport, TransportError

logger = logging.getLogger("gradwatch")

RESUME_MODES = ("allow", "must", "never")
CHECK_TIMEOUT_S = 5.0
RESUME_GRACE_STEPS = 2  # optimizer steps a resumed run waits for run.step / log(step=) before going on
RESUME_HOLD_MAX_ITEMS = 10_000  # ... and observations it holds meanwhile (bounded memory)
RESUME_EVENT = "resume"


@dataclass
class PendingResume:
    """A resumed run whose step is not settled yet. start: the step counter it began with (the
    server's last step + 1, else 0); known: whether the server told that last step."""

    mode: str
    start: int
    known: bool
    before: dict[str, Any] | None = None  # the run's status and reason as init() found them


@dataclass(frozen=True)
class _Answer:
    existed: bool | None  # None: the server could not be asked, or did not say
    last_step: int | None = None
    before: dict[str, Any] | None = None  # previous_status / previous_status_reason, as the server said


def validate(mode: object) -> str | None:
    if mode is None:
        return None
    if isinstance(mode, str) and mode in RESUME_MODES:
        return mode
    raise ValueError(f"resume must be one of {RESUME_MODES} or None, got {mode!r}")


def begin(
    mode: str | None,
    run_mode: str,
    transport: Transport | None,
    document: dict[str, Any],
    id_known: bool,
    rank: int = 0,
) -> PendingResume | None:
    """At init(): what resuming means for this run (None: it is a new run, or resume was not asked).
    Raises ResumeError on the server's definite answer against `mode`, ValueError on misuse. In a
    distributed job only rank 0 checks "never": the other ranks share the run it creates."""
    if mode is None or (mode == "never" and rank != 0):
        return None
    if not id_known:
        if mode == "must":
            raise ValueError(
                "resume='must' needs the id of the run to continue: pass run_id= (store run.id in your "
                "checkpoint) or set GRADWATCH_RUN_ID"
            )
        return None  # nothing to resume: a new run with a new id
    answer = _ask(transport, document, mode) if run_mode == "online" and transport is not None else None
    if answer is None or answer.existed is None:
        return None if mode == "never" else PendingResume(mode, 0, known=False)
    if not answer.existed or answer.last_step is None:
        # "allow" and "never" with a new id: the server created the run; or it has no data yet (another
        # rank of this job created it a moment ago, or it died before its first batch): nothing to resume.
        return None
    return PendingResume(mode, answer.last_step + 1, known=True, before=answer.before)


def _ask(transport: Transport, document: dict[str, Any], mode: str) -> _Answer | None:
    """POST the run with `resume`; None when the server could not be asked (a warning says so)."""
    run_id = document.get("id")
    asker: Any = transport
    if isinstance(transport, HttpTransport):  # init() waits for this one: a short timeout of its own
        timeout = min(transport.timeout, CHECK_TIMEOUT_S)
        asker = HttpTransport(transport.base, transport.token, timeout=timeout)
    try:
        return _post_resume(asker, document, mode, run_id)
    finally:
        if asker is not transport:
            asker.close()


def _post_resume(asker: Any, document: dict[str, Any], mode: str, run_id: Any) -> _Answer | None:
    try:
        answer = asker.create_run({**document, "resume": mode})
    except TransportError as exc:
        if exc.status == 404 and mode == "must":
            raise ResumeError(f"gradwatch: cannot resume run {run_id!r}: {exc}") from None
        if exc.status == 409 and mode == "never":
            raise ResumeError(f"gradwatch: run {run_id!r} exists already (resume='never'): {exc}") from None
        _cannot_ask(run_id, mode, exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a custom transport's own failure: go on as if offline
        _cannot_ask(run_id, mode, exc)
        return None
    if not isinstance(answer, dict):
        return None  # a transport that does not return the run (tests' recorders)
    resumed = answer.get("resumed")
    last_step = answer.get("last_step")
    last = last_step if isinstance(last_step, int) and not isinstance(last_step, bool) else None
    if isinstance(resumed, bool):  # the server says (its id may differ from ours: RemoteRun.adopt)
        before = (
            {key: answer.get(key) for key in ("previous_status", "previous_status_reason")}
            if isinstance(answer.get("previous_status"), str)
            else None
        )
        return _Answer(existed=resumed, last_step=last, before=before)
    given = answer.get("id")
    if given and given != run_id:  # a server without resume support made a new run under another id
        return _Answer(existed=False)
    return _Answer(existed=last is not None, last_step=last)  # a server without resume support


def _cannot_ask(run_id: Any, mode: str, exc: BaseException) -> None:
    then = (
        "a new run is started as usual"
        if mode == "never"
        else "the run is resumed as asked and the server records it when the data arrives"
    )
    logger.warning(
        "gradwatch: could not ask the server whether run %s exists (resume=%r): %s; %s",
        run_id,
        mode,
        exc,
        then,
    )


def resume_data(pending: PendingResume, source: str) -> dict[str, Any]:
    """The `resume` event's data (the server adds what the resume replaced)."""
    return {"mode": pending.mode, "step_from": source, **(pending.before or {})}


def warn_unknown_step(run_id: str) -> None:
    logger.warning(
        "gradwatch: run %s resumes at step 0: neither run.step nor run.log(step=) said where the "
        "checkpoint was, and the server could not be asked for the run's last step; the earlier "
        "points from step 0 on are replaced. Set run.step from your checkpoint after init()",
        run_id,
    )
