"""What the guard can decide without a server: the verdicts of an offline run (mode="offline").

An online run's incidents come from the server's rules. An offline run has no server to ask, so with a
guard the agent judges, in the training thread at each step boundary, the three troubles it can tell
alone from the values it records anyway:

- the loss (the user's "loss", else what the agent took from scaler.scale()) is NaN or infinite;
- a non-finite gradient norm reached the weights: an optimizer step applied without a GradScaler to
  skip it (the weights are NaN/inf from here on);
- a skip storm: after the scaler's calibration (it ends at CALIBRATION_CLEAN_STEPS applied steps in a
  row; a restored scaler state starts a new one), SKIP_STORM_COUNT skipped steps within
  SKIP_STORM_WINDOW steps, a skip right after the scale grew (the sawtooth's probe) not counted.

These mirror the server's default rules loss_non_finite, non_finite and skip_storm at their default
parameters (gradwatch.server.alerts.rules; the agent does not import the server). Each verdict is an
incident shaped like the server's (severity critical), with a negative id so it can never be taken for
one of the server's. Reading the values costs one host read of the step's norm, loss and skip flag per
step (on an accelerator, a synchronisation): only an offline run with a guard pays it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["CALIBRATION_CLEAN_STEPS", "SKIP_STORM_COUNT", "SKIP_STORM_WINDOW", "OfflineVerdicts"]

CALIBRATION_CLEAN_STEPS = 10
SKIP_STORM_COUNT = 4
SKIP_STORM_WINDOW = 50

# The keys of the step the verdicts read (recorded by the Watcher through the run's sink).
WATCHED_KEYS = frozenset(
    {"grad/global_norm", "grad/global_norm_post_clip", "amp/skipped", "amp/scale", "amp/loss"}
)


def _number(value: Any) -> float | None:
    """A recorded value (a number or a one-element tensor) as a float; None when it is neither."""
    detach = getattr(value, "detach", None)  # a loss tensor still attached to its graph
    try:
        return float(detach() if callable(detach) else value)
    except (TypeError, ValueError, RuntimeError):
        return None


class OfflineVerdicts:
    """Fed the step's values as they are recorded; `judge(step)` at the step's end returns the incidents
    open after it (each a dict shaped like the server's incidents)."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}  # this step's recorded values, read at its end
        self._user_loss: Any = None
        self._incidents: dict[int, dict[str, Any]] = {}
        # the scaler's story: calibrating until CALIBRATION_CLEAN_STEPS applied steps in a row
        self._calibrating = True
        self._clean = 0
        self._scale: float | None = None  # the scale after the last step
        self._grown = False  # the scale grew since the last skip
        self._skips: deque[int] = deque()  # counted skips (after calibration, no probe) in the window

    # -- fed while the step runs (training thread) ---------------------------------------------------

    def note(self, key: str, value: Any) -> None:
        self._values[key] = value

    def note_loss(self, value: Any) -> None:
        """run.log({"loss": ...}): the user's loss wins over the agent's amp/loss."""
        self._user_loss = value

    def scaler_restored(self) -> None:
        """A scaler state was loaded (a resume): its scale starts a new calibration."""
        self._calibrating, self._clean, self._scale, self._grown = True, 0, None, False

    # -- at the step's end ---------------------------------------------------------------------------

    def judge(self, step: int) -> list[dict[str, Any]]:
        values, self._values = self._values, {}
        loss_value, self._user_loss = self._user_loss, None
        if loss_value is None:
            loss_value = values.get("amp/loss")
        loss = _number(loss_value) if loss_value is not None else None
        # What reached the weights: the gradients as the loop left them (after a clip or any rewrite).
        applied_key = (
            "grad/global_norm_post_clip" if "grad/global_norm_post_clip" in values else "grad/global_norm"
        )
        norm = _number(values[applied_key]) if applied_key in values else None
        skipped_value = _number(values["amp/skipped"]) if "amp/skipped" in values else None
        skipped = None if skipped_value is None else skipped_value >= 0.5
        scale = _number(values["amp/scale"]) if "amp/scale" in values else None

        if loss is not None and not math.isfinite(loss):
            self._open(
                -1,
                step,
                "loss_non_finite",
                "data",
                f"the loss is {_spelled(loss)} at step {step} (judged by the agent: offline run)",
                "loss_non_finite",
            )
        if norm is not None and not math.isfinite(norm) and skipped is not True:
            self._open(
                -2,
                step,
                "non_finite",
                "precision",
                f"gradient norm is {_spelled(norm)} at step {step}, and the optimizer step was applied "
                "(judged by the agent: offline run)",
                "non_finite_applied",
            )
        if skipped is not None:
            self._scaler_step(step, skipped, scale)
        return [dict(incident) for incident in self._incidents.values()]

    def _scaler_step(self, step: int, skipped: bool, scale: float | None) -> None:
        previous = self._scale
        if scale is not None and math.isfinite(scale):
            self._scale = scale
        if self._calibrating:
            self._clean = 0 if skipped else self._clean + 1
            self._calibrating = self._clean < CALIBRATION_CLEAN_STEPS
            return
        while self._skips and self._skips[0] <= step - SKIP_STORM_WINDOW:
            self._skips.popleft()
        if not skipped:
            # The scaler grew its scale: its first skip after that is the sawtooth's probe.
            now = self._scale
            self._grown = self._grown or (previous is not None and now is not None and now > previous)
            return
        probe, self._grown = self._grown, False
        if probe:
            return
        self._skips.append(step)
        if len(self._skips) >= SKIP_STORM_COUNT and -3 not in self._incidents:
            first = self._skips[0]
            self._open(
                -3,
                first,
                "skip_storm",
                "precision",
                f"{len(self._skips)} skipped steps within {SKIP_STORM_WINDOW} steps after the scaler's "
                f"calibration (steps {first}-{step}; judged by the agent: offline run)",
                "skip_storm",
                last_step=step,
            )

    def _open(
        self,
        incident_id: int,
        step: int,
        rule: str,
        family: str,
        title: str,
        cause_key: str,
        last_step: int | None = None,
    ) -> None:
        if incident_id in self._incidents:
            return  # the first evidence names where to rewind; later steps change nothing
        last = step if last_step is None else last_step
        self._incidents[incident_id] = {
            "id": incident_id,
            "status": "open",
            "severity": "critical",
            "family": family,
            "cause_key": cause_key,
            "title": title,
            "cause": None,
            "next_steps": [],
            "rules": [rule],
            "layers": [],
            "first_step": step,
            "last_step": last,
            "last_healthy_step": step - 1 if step > 0 else None,
            "suspect_steps": [step, last],
            "suspect_batches": [],
            "link": None,
            "judged_by": "agent",
        }


def _spelled(value: float) -> str:
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
