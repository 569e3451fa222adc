"""The agent's one rule about failure: never raise into the training loop; and the one tree of what
gradwatch raises.

`guarded(feature)` wraps the agent's own observation code; the first exception disables that feature
with one warning and every later call returns at once. Misuse of the public API at setup time
(init/watch arguments) is still reported with a ValueError naming the bad value.

Everything gradwatch raises is a GradwatchError (`except gradwatch.GradwatchError` catches it all);
classes that were RuntimeErrors before the tree had a root stay RuntimeErrors too:

    GradwatchError
    ├── ApiError                 a request to the server's API failed: status (None when no answer
    │   │                        came; status_code is the same), detail (the server's message), url
    │   ├── ApiUnavailable       no answer, or the server failed on its side (5xx)
    │   │   └── ApiUnreachable   no answer: refused, timed out, reset
    │   └── RunNotFound          404 for a run asked for by id (the dashboard's client); run_id
    ├── ResumeError              init(resume=...) found what the server says is not so; a RuntimeError
    ├── TrainingHalted           the guard stopped training on an incident (run.log(), only with
    │                            Guard(raise_on_stop=True)); .incident (gradwatch._guard)
    ├── TransportError           one send of the agent's failed (gradwatch._transport); retryable
    ├── GradwatchServerError     the store's errors, one HTTP status each (gradwatch.server.errors)
    ├── SchemaError              the database's schema is stale (gradwatch.server.database); a RuntimeError
    ├── ExposureRefused          an open server on a non-loopback address (gradwatch.server.serve); a
    │                            RuntimeError
    ├── IngestLimited            a batch refused by an ingest limit, answered 413 or 429
    │                            (gradwatch.server.ingest_limits)
    ├── EgressRefused            a webhook host the server must not send to; a ValueError
    │                            (gradwatch.server.alerts.egress)
    └── HostNotPublic            a webhook host without a public address; an httpx.ConnectError, so that
                                 its delivery is retried (gradwatch.server.alerts.egress)

Warnings are not errors: GradwatchWarning is a UserWarning.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

logger = logging.getLogger("gradwatch")

F = TypeVar("F", bound=Callable[..., Any])


class GradwatchWarning(UserWarning):
    """Something inside gradwatch failed or was misused; training continues unchanged."""


class GradwatchError(Exception):
    """Root of everything gradwatch raises."""


class ApiError(GradwatchError):
    """A request to the gradwatch server's API failed.

    status: the HTTP status (401 no or bad token, 403 the token may not read this, 404 no such run…),
    None when no answer came; status_code: the same (the dashboard's name for it); detail: the
    server's own message (the message itself when there is none); url: what was asked, when known."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        detail: str | None = None,
        url: str = "",
        *,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status if status is not None else status_code
        self.detail = detail or message
        self.url = url

    @property
    def status_code(self) -> int | None:
        return self.status


class ApiUnavailable(ApiError):
    """The API did not answer (down, unreachable, timed out) or failed on its side (5xx)."""


class ApiUnreachable(ApiUnavailable):
    """No answer: the server is down, the URL is wrong, or it timed out."""


class RunNotFound(ApiError):
    """The server has no run with this id."""

    def __init__(self, run_id: str, message: str, url: str = "") -> None:
        super().__init__(message, 404, message, url)
        self.run_id = run_id


class ResumeError(GradwatchError, RuntimeError):
    """gradwatch.init(resume=...) asked for what the server says is not so: resume="must" for a run it
    does not have, resume="never" for an id it has. Raised by init() only, never during training."""


def crash_details(exc: BaseException | None) -> dict[str, Any]:
    """What a `crash` event says about the exception that ended a run: its type, message (at most
    500 characters) and where it was raised ("file.py:12 in train")."""
    if exc is None:
        return {}
    details: dict[str, Any] = {"exception": type(exc).__name__, "message": str(exc)[:500]}
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        details["at"] = f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name}"
    return details


class FeatureSwitch:
    """Tracks which agent features have been disabled after an internal error."""

    def __init__(self) -> None:
        self.disabled: dict[str, str] = {}

    def guarded(self, feature: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if feature in self.disabled:
                    return None
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - the whole point: nothing reaches the loop
                    self.disable(feature, exc)
                    return None

            return cast(F, wrapper)

        return decorate

    def disable(self, feature: str, exc: BaseException) -> None:
        if feature in self.disabled:
            return
        self.disabled[feature] = f"{type(exc).__name__}: {exc}"
        message = (
            f"gradwatch: {feature} disabled after an internal error ({type(exc).__name__}: {exc}); "
            "training continues unchanged"
        )
        logger.warning(message, exc_info=exc)
        warnings.warn(message, GradwatchWarning, stacklevel=3)
