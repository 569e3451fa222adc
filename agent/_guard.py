"""The guard: acting on an incident, in the training thread, only when the user asked for it.

Off unless `run.watch(..., guard=...)` turns it on. The server judges the run's batches as they arrive;
with a guard, each batch's acknowledgement carries the run's open incidents (POST .../batches?guard=true),
which the sender's uploader thread hands to `Guard.receive` and nothing more. At the next optimizer
step's end, in the training thread (never from autograd, never from the sender), `Guard.at_step_boundary`
takes what arrived: it calls the user's `on_incident(incident)` once per incident (again when its
cause or severity changes) and, for the incidents `stop_on` chooses (default: critical ones), sets
`should_stop`, which the loop reads as `run.should_stop`; with `raise_on_stop=True` the next
`run.log()` raises `TrainingHalted` instead.

Distributed: every rank's batches are answered with the run's incidents, but at different moments, so
the ranks agree before any of them stops: every `sync_every` steps each rank contributes its wish to
stop to one all-reduce (MAX) on the default process group, and all of them see the same answer at the
same step. No rank is left waiting in a collective its peers skipped. That collective is the guard's
only cost, and it is the user's choice.

An incident (a dict) has: id, status, severity, family, cause_key, title, cause, next_steps, rules,
layers, first_step, last_step, last_healthy_step (the step before its first evidence: rewind to a
checkpoint at or before it), suspect_steps ([first, last]), suspect_batches (ids from run.log_batch
the evidence named), link.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

from ._errors import GradwatchError
from ._guard_offline import OfflineVerdicts

__all__ = ["Guard", "TrainingHalted"]

logger = logging.getLogger("gradwatch")

Incident = dict[str, Any]
SEVERITIES = ("info", "warning", "critical")


class TrainingHalted(GradwatchError):
    """The guard stopped training on an incident (raised by run.log() only with
    Guard(raise_on_stop=True)); `incident` is what stopped it."""

    def __init__(self, incident: Incident) -> None:
        self.incident = incident
        super().__init__(
            f"gradwatch stopped training at step {incident.get('stopped_at_step')}: {incident.get('title')} "
            f"(last healthy step {incident.get('last_healthy_step')})"
        )


class Guard:
    """What to do when the server (or the agent) finds an incident in this run.

    on_incident: called in the training thread at a step boundary with each new or changed incident.
    stop_on: the incidents that stop training: severities ("critical", "warning"), cause keys
        ("loss_divergence", "skip_storm"...), or a callable(incident) -> bool; () never stops.
    raise_on_stop: run.log() raises TrainingHalted once should_stop is true (else the loop reads
        run.should_stop).
    sync_every: in a distributed job, the ranks agree on stopping every this many steps.
    """

    def __init__(
        self,
        on_incident: Callable[[Incident], Any] | None = None,
        *,
        stop_on: Collection[str] | Callable[[Incident], bool] = ("critical",),
        raise_on_stop: bool = False,
        sync_every: int = 10,
    ) -> None:
        if on_incident is not None and not callable(on_incident):
            raise TypeError(f"on_incident must be callable, got {type(on_incident).__name__}")
        if not callable(stop_on) and (isinstance(stop_on, str) or not isinstance(stop_on, Collection)):
            raise TypeError(f"stop_on must be a collection of severities or cause keys, got {stop_on!r}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a whole number of steps >= 1, got {sync_every!r}")
        self.on_incident = on_incident
        self.stop_on = stop_on
        self.raise_on_stop = bool(raise_on_stop)
        self.sync_every = sync_every
        self.should_stop = False
        self.stopped_by: Incident | None = None  # the incident that set should_stop
        self.stopped_at_step: int | None = None
        self._lock = threading.Lock()
        self._arrived: dict[int, Incident] = {}  # id -> latest version, from the uploader thread
        self._seen: dict[int, tuple[Any, Any]] = {}  # id -> (cause_key, severity) handed to the user
        self._wants_stop: Incident | None = None  # this rank's wish, before the ranks agree
        self._raised = False
        self._callback_failed = False
        # An offline run's own verdicts (gradwatch._guard_offline), set by watch(); None online.
        self.offline: OfflineVerdicts | None = None

    @classmethod
    def from_argument(cls, guard: Any) -> Guard | None:
        """watch(guard=...): a Guard, True (the defaults), a callable (on_incident), or None/False."""
        if guard is None or guard is False:
            return None
        if guard is True:
            return cls()
        if isinstance(guard, Guard):
            return guard
        if callable(guard):
            return cls(on_incident=guard)
        raise ValueError(f"guard must be a gradwatch.Guard, True or a callable, got {type(guard).__name__}")

    # -- any thread --------------------------------------------------------------------------------

    def receive(self, incidents: Any) -> None:
        """The run's open incidents, as a batch's acknowledgement carried them (the uploader thread)."""
        if not isinstance(incidents, list):
            return
        with self._lock:
            for incident in incidents:
                if isinstance(incident, dict) and isinstance(incident.get("id"), int):
                    self._arrived[incident["id"]] = incident

    # -- the training thread -----------------------------------------------------------------------

    def at_step_boundary(self, step: int) -> bool:
        """Hand what arrived to the user and decide whether to stop (the step that ended is step-1).
        True when training stops here (once): the run records a `guard_stop` event."""
        with self._lock:
            arrived, self._arrived = self._arrived, {}
        for incident_id, incident in sorted(arrived.items()):
            version = (incident.get("cause_key"), incident.get("severity"))
            if self._seen.get(incident_id) == version:
                continue
            self._seen[incident_id] = version
            self._hand_over(incident)
            if self._wants_stop is None and self._stops(incident):
                self._wants_stop = incident
        if self.should_stop or (self._wants_stop is None and not _distributed()):
            return False
        if _distributed():
            if step % self.sync_every:
                return False
            if not _any_rank(self._wants_stop is not None):
                return False
        self.should_stop = True
        self.stopped_at_step = step
        self.stopped_by = dict(self._wants_stop or {"title": "another rank's guard stopped training"})
        self.stopped_by["stopped_at_step"] = step
        logger.warning(
            "gradwatch: the guard stops training at step %s: %s", step, self.stopped_by.get("title")
        )
        return True

    def stop_event(self) -> dict[str, Any]:
        """The `guard_stop` event's data: what stopped training, and where to rewind to."""
        incident = self.stopped_by or {}
        keys = ("id", "cause_key", "severity", "title", "first_step", "last_healthy_step", "suspect_batches")
        return {key: incident.get(key) for key in keys}

    def halt_if_asked(self) -> None:
        """run.log(): raise TrainingHalted once, when the user opted in and training should stop."""
        if self.raise_on_stop and self.should_stop and not self._raised:
            self._raised = True
            raise TrainingHalted(self.stopped_by or {})

    def _stops(self, incident: Incident) -> bool:
        if incident.get("status", "open") != "open":
            return False
        if callable(self.stop_on):
            try:
                return bool(self.stop_on(incident))
            except Exception:
                logger.warning("gradwatch: the guard's stop_on failed; it stops nothing", exc_info=True)
                self.stop_on = ()
                return False
        return incident.get("severity") in self.stop_on or incident.get("cause_key") in self.stop_on

    def _hand_over(self, incident: Incident) -> None:
        if self.on_incident is None or self._callback_failed:
            return
        try:
            self.on_incident(dict(incident))
        except Exception:
            self._callback_failed = True
            logger.warning("gradwatch: the guard's on_incident raised; it is not called again", exc_info=True)


def _distributed() -> bool:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _any_rank(mine: bool) -> bool:
    """Whether any rank wants to stop: one all-reduce (MAX) of one number on the default group, on the
    device its backend reduces on."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
