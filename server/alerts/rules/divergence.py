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


def _upper_noise(window: list[float]) -> float:
    """How far the loss's batches reach above its level: the third-highest residual of the window's losses
    over their running median of 5 (a wider window than the best median's: one picked for its low median
    is also one with few high batches). Over the trend, not the raw values: a window that still holds a
    fast early fall (4.2 -> 0.9 in 20 steps) would put the reach at the fall's start and hide any climb
    back; on a level window it is the third-highest loss's distance from the level, as before."""
    residuals = sorted(
        value - statistics.median(window[max(0, i - 2) : i + 3]) for i, value in enumerate(window)
    )
    return max(residuals[max(len(residuals) - 3, 0)], 0.0)


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
        # The best level is looked for once `baseline` losses exist: a loss that falls fast in a warm-up and
        # leaves its range within tens of steps (a ramp to too high a peak) has left before a longer window
        # would fill. Its noise's upper reach is read over up to 3 x baseline losses around their trend.
        ready = len(recent) >= self.baseline
        if ready and (best is None or center < best[1]):
            upper = center + _upper_noise(recent[-UPPER_SPAN * self.baseline :])  # when the best moves
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
        if state["count"] <= self.warmup or best is None or len(recent) < max(self.smooth, self.baseline):
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
        "times the peak the run had settled on (no higher lr for `lr_settle` steps); or the gradient norm's "
        "median is `norm_climb` times that of the `lr_settle` steps before while the loss has stopped "
        "falling and the lr is not falling."
    )
    params: ClassVar[dict[str, Param]] = {
        **LossDivergence.params,
        "factor": Param(1.5, minimum=1.0, exclusive_minimum=True, doc="median / best level"),
        "give_back": Param(0.02, minimum=0.0, maximum=1.0, doc="share of the progress lost again"),
        "norm_rise": Param(2.0, minimum=1.0, doc="gradient norm now / at the best step"),
        "lr_rise": Param(2.0, minimum=1.0, exclusive_minimum=True, doc="lr now / settled peak or best"),
        "lr_settle": Param(20, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps without a higher lr"),
        "norm_climb": Param(
            3.0, minimum=1.0, exclusive_minimum=True, doc="gradient norm now / the `lr_settle` steps before"
        ),
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
        if isinstance(verdict, Finding):
            return verdict
        climb = self._norm_climb(state, data)
        if climb is not None:
            return climb
        if verdict is CLEAR and state.get("climbing"):
            return None  # the norm's climb is still half way up: not over yet
        peak, lr = state.get("lr_settled"), state["lr"]
        if not (_finite(peak) and _finite(lr) and peak > 0) or lr < self.lr_rise * peak:
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

    def _norm_climb(self, state: LossDivergenceState, data: StepData) -> Finding | None:
        """The gradient norm climbing at the edge of stability, before the loss follows: its median of
        `smooth` steps is `norm_climb` times its median over the `lr_settle` steps before, while the loss
        has stopped falling (its median of `smooth` steps not 5% under that of the `lr_settle` before) and
        the lr is not below its value at the window's start (a warm-up still ramping, a constant lr).
        Not a cosine decay to 0 (the norm often grows as the lr falls), nor one spike (a median), nor a
        loss still falling. A warm-up that outruns the model shows here: the norm spikes more and more
        often for some steps before the loss leaves its range."""
        history = state.get("norm_history") or []
        best, level = state["best"], self._level(state)
        state["climbing"] = False
        if (
            best is None
            or level is None
            or state["count"] <= self.warmup
            or len(history) < self.lr_settle + self.smooth
        ):
            return None
        norms = [norm for norm, _ in history]
        now, before = statistics.median(norms[-self.smooth :]), statistics.median(norms[: -self.smooth])
        lr_now, lr_then = state["lr"], history[0][1]
        if before <= 0 or not (_finite(lr_now) and _finite(lr_then)) or lr_now < lr_then:
            return None
        ratio = now / before
        state["climbing"] = bool(state.get("climb_open")) and ratio >= (1 + self.norm_climb) / 2
        losses = state["recent"][-(self.lr_settle + self.smooth) : -self.smooth]
        falling = len(losses) < self.lr_settle or level < 0.95 * statistics.median(losses)
        if ratio < self.norm_climb or falling:
            if not state["climbing"]:
                state["climb_open"] = False
            return None
        # No streak on top: the median already needs 3 of the 5 norms up, and the norm leads the loss
        # by only a few steps here.
        state["open"] = state["climb_open"] = state["climbing"] = True
        precursors = [f"the gradient norm rose {ratio:.3g}x in {self.lr_settle + self.smooth} steps"]
        if lr_then > 0 and lr_now >= 1.2 * lr_then:
            precursors.append(f"the learning rate rose {lr_now / lr_then:.3g}x to {lr_now:.3g}")
        return Finding(
            data.step,
            f"divergence ahead: the gradient norm {now:.3g} (median of {self.smooth} steps) is {ratio:.3g}x "
            f"its level {before:.3g} of the {self.lr_settle} steps before, and {state['key']} has stopped "
            f"falling ({level:.4g}, best {best[1]:.4g} at step {best[0]})",
            LossDivergenceEvidence(
                key=str(state["key"]),
                steps=[int(best[0]), data.step],
                values=[best[1], level],
                ratio=level / best[1] if best[1] > 0 else 1.0,
                start_level=float(state["start"] or 0.0),
                onset_step=data.step,
                rising_step=state.get("rising"),
                grad_norm=[before, now],
                lr=[lr_then, lr_now],
                clipped_share=[best[4], self._clip_share(state)],
                precursors=precursors,
            ),
        )

    def _level(self, state: LossDivergenceState) -> float | None:
        recent = state["recent"]
        return statistics.median(recent[-self.smooth :]) if recent else None

    def _track(self, state: LossDivergenceState, data: StepData) -> None:
        previous_max = state["lr_max"]
        super()._track(state, data)
        norm = data.scalars.get("grad/global_norm")
        if _finite(norm) and _finite(state["lr"]):
            state["norm_history"] = [*(state.get("norm_history") or []), [norm, state["lr"]]][
                -(self.lr_settle + self.smooth) :
            ]
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
