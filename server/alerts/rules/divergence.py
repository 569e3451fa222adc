"""A divergence that stays finite: the loss leaves the range it had reached (loss_divergence).

The spike rules compare each step with a moving baseline: a loss that climbs over tens of steps drags
its baseline up with it and never stands out, and a loss that climbs and then stays up (a post-LayerNorm
transformer at too high an lr: from 0.26 to 5.2, then ~2.4 for the rest of the run) is finite, so
loss_non_finite never fires either. This rule keeps the run's best level instead: the running minimum of
the loss's short median. The loss has left its range when that median is `factor` times the minimum and
the run has given back at least `give_back` of what it had learned (from its first level down to the
minimum), so a near-converged loss whose noise is large relative to its value (0.005 -> 0.02) stays
silent; so do one-step bumps (the median of `smooth` steps) and the climb after a scheduled lr restart
while it stays below the run's first level. Its evidence names what moved with the loss since its best
step: the gradient norm, the learning rate and the share of steps the clip cut.
"""

from __future__ import annotations

import statistics
from typing import Any, ClassVar, cast

from ..evidence import LossDivergenceEvidence
from .base import (
    CLEAR,
    LOSS_KEYS,
    MAX_STEPS,
    MAX_WINDOW,
    Finding,
    Param,
    RuleType,
    StepData,
    Verdict,
    _finite,
)
from .states import LossDivergenceState

__all__ = ["DivergenceWarning", "LossDivergence"]

UPPER_SPAN = 3  # the upper noise of the best level is read over this many baseline windows


class LossDivergence(RuleType[LossDivergenceState]):
    name = "loss_divergence"
    severity = "critical"
    family = "divergence"
    description = (
        "The loss left the range it had reached, finite or not yet NaN: on `sustain` steps in a row the "
        "median of its last `smooth` values is at least `factor` times its best level (the lowest median of "
        "`baseline` steps so far) and it has given back at least `give_back` of the way from its first "
        "level to that best (after `warmup` steps; within `restart_grace` steps of a scheduled lr restart "
        "only above the first level). Clears when the median is back under the midpoint of 1 and `factor` "
        "times the best level."
    )
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(3.0, minimum=1.0, exclusive_minimum=True, doc="median / running minimum"),
        "give_back": Param(0.25, minimum=0.0, maximum=1.0, doc="share of the progress lost again"),
        "smooth": Param(5, minimum=1, maximum=99, integer=True, doc="steps in the median judged"),
        "baseline": Param(
            15,
            minimum=1,
            maximum=999,
            integer=True,
            doc="steps in the median whose minimum is the best level",
        ),
        "sustain": Param(3, minimum=1, maximum=99, integer=True, doc="consecutive steps out of range"),
        "warmup": Param(20, minimum=1, maximum=MAX_WINDOW, integer=True, doc="loss points before judging"),
        "restart_grace": Param(
            200, minimum=0, maximum=MAX_STEPS, integer=True, doc="steps after a scheduled lr restart"
        ),
    }
    scalar_keys = frozenset(
        {*LOSS_KEYS, "lr", "grad/global_norm", "grad/global_norm_post_clip", "grad/clip_max_norm"}
    )

    def initial_state(self) -> LossDivergenceState:
        return {
            "recent": [],
            "count": 0,
            "start": None,
            "best": None,
            "norms": [],
            "clipped": [],
            "lr": None,
            "lr_max": None,
            "grace_until": -1,
            "open": False,
            "key": None,
            "rising": None,
            "streak": 0,
            "out_since": None,
        }

    def observe(self, state: LossDivergenceState, data: StepData, layers: list[str]) -> Verdict:
        self._track(state, data)
        key = self._key(state, data)
        value = data.scalars.get(key) if key is not None else None
        if key is None or not _finite(value):
            return None  # non-finite losses are loss_non_finite's
        recent = state["recent"] = [*state["recent"], value][-max(self.smooth, UPPER_SPAN * self.baseline) :]
        state["count"] += 1
        level = statistics.median(recent[-self.smooth :])
        # The best level is the lowest median of `baseline` steps, not of `smooth`: the minimum of short
        # medians of a noisy loss sits in its noise's low tail, and the loss's usual noise would then
        # look 3x above it now and then.
        center = statistics.median(recent[-self.baseline :])
        if state["count"] <= self.warmup:
            state["start"] = level if state["start"] is None else max(state["start"], level)
        best = state["best"]
        # The noise's upper reach around the best level: the third-highest of the last 3 x baseline losses,
        # a wider window than the one the best median was chosen from (a window picked for its low median
        # is also one with few high batches); the best level is looked for once that window is full.
        full = len(recent) >= UPPER_SPAN * self.baseline  # the upper reach is read over a full window
        if full and (best is None or center < best[1]):
            window = sorted(recent[-UPPER_SPAN * self.baseline :])  # only when the best level moves
            upper = window[max(len(window) - 3, 0)]
            best = state["best"] = [
                data.step,
                center,
                self._norm(state),
                state["lr"],
                self._clip_share(state),
                upper,
            ]
            state["rising"] = None
        elif best is not None and state.get("rising") is None and level >= (1 + self.factor) / 2 * best[1]:
            state["rising"] = data.step  # half way out of the range: where the climb shows
        if (
            state["count"] <= self.warmup
            or best is None
            or len(recent) < max(self.smooth, UPPER_SPAN * self.baseline)
        ):
            return None
        start, minimum = state["start"], best[1]
        if start is None or minimum <= 0:
            return None  # a loss that is not positive has no ratio to its minimum
        left = self._left(state, level, best, start)
        if left and data.step <= state["grace_until"]:
            left = level > start  # after a scheduled restart: only worse than where the run began
        state["streak"] = state.get("streak", 0) + 1 if left else 0
        if state["streak"] == 1:
            state["out_since"] = data.step
        if not left:
            if state["open"] and level < (1 + self.factor) / 2 * minimum:
                state["open"] = False
                return CLEAR
            return None
        if state["streak"] < self.sustain:
            return None
        state["open"] = True
        return self._finding(state, data.step, key, level, best)

    def _left(self, state: LossDivergenceState, level: float, best: list[Any], start: float) -> bool:
        """Whether the level is out of the range the best level set (before the restart grace)."""
        minimum = best[1]
        # Above the best window's own upper noise too: a loss whose batches alternate between two levels
        # (0.01 and 0.3) has a best median near the lower one, and 3 high batches of 5 are no climb.
        upper = best[5] if len(best) > 5 and _finite(best[5]) else minimum
        return (
            level >= self.factor * minimum
            and level > upper
            and level - minimum >= self.give_back * max(start - minimum, 0.0)
        )

    def _headline(self, key: str, level: float, minimum: float, best_step: int) -> str:
        return (
            f"{key} left its range: {level:.4g} (median of {self.smooth} steps) is {level / minimum:.3g}x "
            f"its best level {minimum:.4g} at step {best_step}"
        )

    def _finding(
        self, state: LossDivergenceState, step: int, key: str, level: float, best: list[Any]
    ) -> Finding:
        best_step, minimum, norm_then, lr_then, clip_then = best[:5]
        norm_now, lr_now, clip_now = self._norm(state), state["lr"], self._clip_share(state)
        precursors: list[str] = []
        if _finite(norm_then) and _finite(norm_now) and norm_then > 0 and norm_now >= 2 * norm_then:
            precursors.append(f"the gradient norm rose {norm_now / norm_then:.3g}x")
        if _finite(lr_then) and _finite(lr_now) and lr_then > 0 and lr_now >= 1.5 * lr_then:
            precursors.append(f"the learning rate rose {lr_now / lr_then:.3g}x to {lr_now:.3g}")
        if clip_now is not None and clip_now >= 0.5 and (clip_then is None or clip_now >= clip_then + 0.25):
            precursors.append(f"the clip cut {clip_now:.0%} of the last steps")
        since = f"; since then {', '.join(precursors)}" if precursors else ""
        return Finding(
            step,
            self._headline(key, level, minimum, best_step) + since,
            LossDivergenceEvidence(
                key=key,
                steps=[int(best_step), step],
                values=[minimum, level],
                ratio=level / minimum,
                start_level=float(state["start"] or 0.0),
                onset_step=int(state.get("out_since") or step),
                rising_step=state.get("rising"),
                grad_norm=[norm_then, norm_now],
                lr=[lr_then, lr_now],
                clipped_share=[clip_then, clip_now],
                precursors=precursors,
            ),
        )

    @staticmethod
    def _key(state: LossDivergenceState, data: StepData) -> str | None:
        """The loss series judged: the user's "loss" once it appears (the history of amp/loss before it,
        the loss as passed to scaler.scale and maybe divided by the micro-batches, is dropped: the two
        never mix in one range), else amp/loss."""
        if "loss" in data.scalars:
            if state.get("key") != "loss":
                state["key"], state["recent"], state["count"], state["start"] = "loss", [], 0, None
                state["best"], state["rising"], state["open"], state["streak"] = None, None, False, 0
            return "loss"
        if state.get("key") == "loss" or "amp/loss" not in data.scalars:
            return None  # a step the user logged no loss for
        state["key"] = "amp/loss"
        return "amp/loss"

    def _track(self, state: LossDivergenceState, data: StepData) -> None:
        """The lr (and restarts), the gradient norm and whether the clip cut, per step."""
        lr = data.scalars.get("lr")
        if _finite(lr):
            previous, peak = state["lr"], state["lr_max"]
            if (
                _finite(previous)
                and previous > 0
                and lr > 2 * previous
                and _finite(peak)
                and lr <= 1.5 * peak
            ):
                state["grace_until"] = data.step + self.restart_grace  # back to a level used before
            state["lr"], state["lr_max"] = lr, lr if peak is None else max(peak, lr)
        norm = data.scalars.get("grad/global_norm")
        if _finite(norm):
            state["norms"] = [*state["norms"], norm][-self.smooth :]
            max_norm = data.scalars.get("grad/clip_max_norm")
            if _finite(max_norm) and max_norm > 0:
                state["clipped"] = [*state["clipped"], 1 if norm > max_norm else 0][-20:]

    def _norm(self, state: LossDivergenceState) -> float | None:
        return statistics.median(state["norms"]) if state["norms"] else None

    @staticmethod
    def _clip_share(state: LossDivergenceState) -> float | None:
        clipped = state["clipped"]
        return sum(clipped) / len(clipped) if len(clipped) >= 5 else None


class DivergenceWarning(LossDivergence):
    """Before the loss leaves its range: the precursors a divergence shows first (issue 38).

    - The loss has started to climb (its median `factor` times its best level and `give_back` of the
      progress lost) while the gradient norm grew `norm_rise` times since the best step, or the learning
      rate `lr_rise` times: the climb of a run whose lr is too high for where it is, not noise.
    - Or, whatever the loss does yet, the learning rate rose past `lr_rise` times the peak the run had
      settled on (a peak no higher lr followed for `lr_settle` steps): a restart or a schedule with a
      mistyped peak. A warm-up never has a settled peak above it; a scheduled restart back to the peak
      does not pass it.
    A warning: the loss_divergence incident, if the climb goes on, follows as critical in the same
    incident."""

    name = "divergence_warning"
    severity = "warning"
    description = (
        "Precursors of a divergence: on `sustain` steps in a row the loss's median is at least `factor` "
        "times its best level (and gave back `give_back` of its progress) while the gradient norm grew "
        "`norm_rise` times since that best step or the lr `lr_rise` times; or the lr rose past `lr_rise` "
        "times the peak the run had settled on (no higher lr for `lr_settle` steps)."
    )
    params: ClassVar[dict[str, Param]] = {
        **LossDivergence.params,
        "factor": Param(1.5, minimum=1.0, exclusive_minimum=True, doc="median / best level"),
        "give_back": Param(0.02, minimum=0.0, maximum=1.0, doc="share of the progress lost again"),
        "norm_rise": Param(2.0, minimum=1.0, doc="gradient norm now / at the best step"),
        "lr_rise": Param(2.0, minimum=1.0, exclusive_minimum=True, doc="lr now / settled peak or best"),
        "lr_settle": Param(20, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps without a higher lr"),
    }

    def observe(self, state: LossDivergenceState, data: StepData, layers: list[str]) -> Verdict:
        return self._keep_first(state, self._precursor(state, data, layers))

    @staticmethod
    def _keep_first(state: LossDivergenceState, verdict: Verdict) -> Verdict:
        """A later finding of the same warning keeps the episode's first precursor in its evidence (and
        so in the incident's title): each finding replaces the alert's last, and the lr passing its
        settled peak at the restart was gone from the card once the loss climb it caused was the news."""
        if verdict is CLEAR:
            state["first_precursor"] = None
            return verdict
        if not isinstance(verdict, Finding):
            return verdict
        evidence = cast(LossDivergenceEvidence, verdict.evidence)
        precursors = evidence["precursors"]
        first = state.get("first_precursor")
        if first is None:
            if precursors:
                state["first_precursor"] = [verdict.step, precursors[0]]
        elif first[0] < verdict.step and not any(first[1] in text for text in precursors):
            evidence["precursors"] = [f"{first[1]} (from step {first[0]})", *precursors]
        return verdict

    def _precursor(self, state: LossDivergenceState, data: StepData, layers: list[str]) -> Verdict:
        verdict = super().observe(state, data, layers)
        peak, lr = state.get("lr_settled"), state["lr"]
        if isinstance(verdict, Finding) or not (_finite(peak) and _finite(lr) and peak > 0):
            return verdict
        if lr < self.lr_rise * peak:
            return verdict
        state["open"] = True
        return Finding(
            data.step,
            f"the learning rate {lr:.3g} is {lr / peak:.3g}x the peak {peak:.3g} the run had settled on: "
            "a restart or schedule with a mistyped peak, before the loss shows it",
            LossDivergenceEvidence(
                key="lr",
                steps=[int(state.get("lr_settled_step") or data.step), data.step],
                values=[peak, lr],
                ratio=lr / peak,
                start_level=float(state["start"] or 0.0),
                onset_step=data.step,
                rising_step=None,
                grad_norm=[None, self._norm(state)],
                lr=[peak, lr],
                clipped_share=[None, self._clip_share(state)],
                precursors=[f"the learning rate rose {lr / peak:.3g}x past its settled peak"],
            ),
        )

    def _track(self, state: LossDivergenceState, data: StepData) -> None:
        previous_max = state["lr_max"]
        super()._track(state, data)
        lr = data.scalars.get("lr")
        if not _finite(lr):
            return
        if previous_max is not None and lr > previous_max:
            state["lr_flat"] = 0  # still rising (a warm-up): no settled peak yet
        else:
            state["lr_flat"] = state.get("lr_flat", 0) + 1
            if state["lr_flat"] >= self.lr_settle and state.get("lr_settled") is None:
                state["lr_settled"], state["lr_settled_step"] = state["lr_max"], data.step

    def _left(self, state: LossDivergenceState, level: float, best: list[Any], start: float) -> bool:
        if not super()._left(state, level, best, start):
            return False
        norm_then, lr_then = best[2], best[3]
        norm_now, lr_now = self._norm(state), state["lr"]
        norm_grew = (
            _finite(norm_then)
            and _finite(norm_now)
            and norm_then > 0
            and norm_now >= self.norm_rise * norm_then
        )
        lr_grew = _finite(lr_then) and _finite(lr_now) and lr_then > 0 and lr_now >= self.lr_rise * lr_then
        return bool(norm_grew or lr_grew)

    def _headline(self, key: str, level: float, minimum: float, best_step: int) -> str:
        return (
            f"divergence ahead: {key} {level:.4g} is {level / minimum:.3g}x its best level {minimum:.4g} "
            f"(step {best_step}) and climbing"
        )
