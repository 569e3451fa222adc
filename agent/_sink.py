"""What a Watcher may do to the run it observes for: the StepSink protocol.

The Run owns its step counter, buffer and flush schedule; a Watcher only reads the current step,
records observations at a step, and says when a step has ended. Keeping that to the few operations
below lets _watch know nothing of _run (no import either way but _run → _watch), and lets a test
drive a Watcher with any object that has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._distributed import ProcessIdentity
    from ._errors import FeatureSwitch


class StepSink(Protocol):
    """The Watcher's view of its run. Every method is called on the training thread."""

    @property
    def step(self) -> int:
        """The current optimizer step: observations made now belong to it (the first step is 0)."""

    @property
    def rank(self) -> int:
        """The rank this run reports under."""

    @property
    def identity(self) -> ProcessIdentity:
        """Who this process is (world size, local rank, host), as the run was started with."""

    @property
    def features(self) -> FeatureSwitch:
        """The run's switch: observation code is wrapped in features.guarded(name); a part that
        cannot work is turned off with features.disable(name, exc) (one warning)."""

    def add_scalar(self, key: str, step: int, value: Any) -> None:
        """Record a number or a one-element tensor (kept on its device until the flush)."""

    def add_tensor(self, key: str, step: int, tensor: Any) -> None:
        """Record a 1-d tensor (one value per layer) or a 2-d one (one row per layer)."""

    def add_event(self, step: int, kind: str, data: dict[str, Any]) -> None:
        """Record an event of `kind` at `step`, with JSON-able `data`."""

    def advance_step(self) -> int:
        """End the current step: the counter moves on by one; returns the new current step."""

    def step_recorded(self) -> None:
        """Everything about the step that just ended has been recorded: the run may flush now."""

    def report_rank_at_finish(self) -> None:
        """This run is one rank of a distributed job: it also says how the rank ended at finish()."""
