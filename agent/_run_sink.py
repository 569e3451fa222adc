"""_RunSink: the StepSink (see _sink) a Run hands its Watcher. It is the Watcher's only way into the
Run (step counter, buffer, flush schedule, rank), kept apart from _run so that the run's own code and
the narrow surface the watching side sees are read and changed separately."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._guard_offline import WATCHED_KEYS

if TYPE_CHECKING:
    from ._distributed import ProcessIdentity
    from ._errors import FeatureSwitch
    from ._run import Run


class _RunSink:
    """The StepSink (see _sink) a Run hands its Watcher: the Run keeps its step counter, buffer and
    flush schedule, and the Watcher reaches them only through these operations."""

    __slots__ = ("_offline", "_run")

    def __init__(self, run: Run) -> None:
        self._run = run
        # An offline run's guard judges the step's values itself (gradwatch._guard_offline).
        self._offline = run.guard.offline if run.guard is not None else None

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
        if self._offline is not None and key in WATCHED_KEYS:
            self._offline.note(key, value)

    def add_tensor(self, key: str, step: int, tensor: Any) -> None:
        self._run.buffer.add_tensor(key, step, tensor)

    def add_event(self, step: int, kind: str, data: dict[str, Any]) -> None:
        self._run.buffer.add_event(step, kind, data)
        if self._offline is not None and kind == "scaler_state_loaded":
            self._offline.scaler_restored()

    def advance_step(self) -> int:
        run = self._run
        run._step += 1
        return run._step

    def step_recorded(self) -> None:
        run = self._run
        run._maybe_flush()
        # A step boundary, in the training thread: the guard acts here; its stop is an event of the run.
        guard = run.guard
        if guard is None:
            return
        if self._offline is not None:
            guard.receive(self._offline.judge(run._step - 1))  # the step that just ended
        if guard.at_step_boundary(run._step):
            run.buffer.add_event(run._step, "guard_stop", guard.stop_event())

    def report_rank_at_finish(self) -> None:
        self._run.reports_rank = True
