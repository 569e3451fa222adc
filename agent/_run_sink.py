"""_RunSink: the StepSink (see _sink) a Run hands its Watcher. It is the Watcher's only way into the
Run (step counter, buffer, flush schedule, rank), kept apart from _run so that the run's own code and
the narrow surface the watching side sees are read and changed separately."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._distributed import ProcessIdentity
    from ._errors import FeatureSwitch
    from ._run import Run


class _RunSink:
    """The StepSink (see _sink) a Run hands its Watcher: the Run keeps its step counter, buffer and
    flush schedule, and the Watcher reaches them only through these operations."""

    __slots__ = ("_run",)

    def __init__(self, run: Run) -> None:
        self._run = run

    @property
    def step(self) -> int:
        return self._run._step

    @property
    def rank(self) -> int:
        return self._run.rank

    @property
    def identity(self) -> ProcessIdentity:
        return self._run.identity

    @property
    def features(self) -> FeatureSwitch:
        return self._run.features

    # The buffer is looked up at each call: a forked child's run gets a new one.
    def add_scalar(self, key: str, step: int, value: Any) -> None:
        self._run.buffer.add_scalar(key, step, value)

    def add_tensor(self, key: str, step: int, tensor: Any) -> None:
        self._run.buffer.add_tensor(key, step, tensor)

    def add_event(self, step: int, kind: str, data: dict[str, Any]) -> None:
        self._run.buffer.add_event(step, kind, data)

    def advance_step(self) -> int:
        run = self._run
        run._step += 1
        return run._step

    def step_recorded(self) -> None:
        run = self._run
        run._maybe_flush()
        # A step boundary, in the training thread: the guard acts here; its stop is an event of the run.
        if run.guard is not None and run.guard.at_step_boundary(run._step):
            run.buffer.add_event(run._step, "guard_stop", run.guard.stop_event())

    def report_rank_at_finish(self) -> None:
        self._run.reports_rank = True
