"""The agent's one rule about failure: never raise into the training loop.

`guarded(feature)` wraps the agent's own observation code; the first exception disables that feature
with one warning and every later call returns at once. Misuse of the public API at setup time
(init/watch arguments) is still reported with a ValueError naming the bad value.
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


class ResumeError(RuntimeError):
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
