"""The run's trends against robust baselines: gradient-norm and loss spikes, learning-rate jumps, and a
clip that cuts the gradient on nearly every step (grad_norm_spike, loss_spike, lr_jump, clip_saturation)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from ..evidence import ClipSaturationEvidence, LrJumpEvidence, SpikeEvidence
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
    _loss_of,
    _times,
)
from .states import ClipSaturationState, LossSpikeState, LrJumpState, SpikeState

__all__ = ["ClipSaturation", "GradNormSpike", "LossSpike", "LrJump"]


def _median_of_sorted(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _median(values: list[float]) -> float:
    return _median_of_sorted(sorted(values))


RECENT = 5  # the sustained rules look at this many latest observations
# A hit must also leave the run's own range: lie above the baseline's TAIL_QUANTILE quantile by
# TAIL_MARGIN times that quantile's distance from the median. Median and MAD ignore a run's outlier
# batches, as they should, but a run that has them (a near-converged classifier whose loss is 0.01
# with one batch in ten at 0.3-0.6) then meets 3 of 5 such batches in a row every few hundred steps
# by chance: no divergence. A diverging run goes past anything it showed before; on a run without
# outliers the quantile is ~2 spreads above the median, far below the z threshold, and changes nothing.
TAIL_QUANTILE = 0.98
TAIL_MARGIN = 0.5


def _beyond_tail(value: float, median: float, tail: float) -> bool:
    return value > tail + TAIL_MARGIN * max(tail - median, 0.0)


# Steps between recomputations of a baseline's median and spread: sorting is O(window), so a baseline is
# refreshed every BASELINE_REFRESH steps or every 1/BASELINE_REFRESH_SHARE of its length, whichever is
# longer (windows up to 200 steps: every 10 steps; the largest, 10,000: every 500). The cost per step then
# stays flat however large a window a rule is given (issue 28: 85 rules with 10,000-step windows held
# SQLite's write lock for minutes on one batch).
BASELINE_REFRESH = 10
BASELINE_REFRESH_SHARE = 20


def _append_bounded(items: list[Any], item: Any, most: int) -> None:
    """Append, then keep the last `most` items, in place: no copy of the window per point."""
    items.append(item)
    if len(items) > most:
        del items[: len(items) - most]


def _baseline_stats(state: SpikeState, step: int, baseline: list[list[float]]) -> tuple[float, float, float]:
    """(median, MAD-based spread, TAIL_QUANTILE quantile) of the baseline's values but its latest
    RECENT ones, cached in state["stats"] for BASELINE_REFRESH steps or a BASELINE_REFRESH_SHARE-th of
    the baseline: the baseline moves slowly, and ingest must stay cheap per point however large the window."""
    cached = state.get("stats")
    refresh = max(BASELINE_REFRESH, len(baseline) // BASELINE_REFRESH_SHARE)
    if cached is None or len(cached) < 4 or step - cached[0] >= refresh or step < cached[0]:
        ordered = sorted(v for _, v in baseline[:-RECENT] or baseline)
        median = _median_of_sorted(ordered)
        tail = ordered[min(len(ordered) - 1, math.ceil(TAIL_QUANTILE * len(ordered)) - 1)]
        spread = 1.4826 * _median([abs(v - median) for v in ordered])
        cached = state["stats"] = [step, median, spread, tail]
    return cached[1], cached[2], cached[3]


Spike = TypeVar("Spike", bound=SpikeState)


class _SustainedSpike(RuleType[Spike]):
    """A value far above a robust baseline on at least `sustain` of the latest RECENT observations
    (grad_norm_spike, loss_spike): state["baseline"] holds [step, judged value] of the `window` steps
    before, state["recent"] the latest [step, hit, value]."""

    family = "divergence"

    def validate(self) -> None:
        if self.warmup > self.window:
            raise ValueError(f"{self.name}: warmup ({self.warmup}) cannot exceed window ({self.window})")

    def _sustained(
        self,
        state: SpikeState,
        step: int,
        hit: bool,
        value: float,
        title: Callable[[str], str],
        evidence: dict[str, Any],
    ) -> Verdict:
        """Record this observation among the recent ones: a Finding when it is a hit and at least
        `sustain` of them are, CLEAR when none is, else None. title("N of the last M steps") names the
        finding; evidence: its "key", then "baseline_median", "ratio" and "z"."""
        recent = [*state.get("recent", []), [step, hit, value]][-RECENT:]
        state["recent"] = recent
        hits = [r for r in recent if r[1]]
        if hit and len(hits) >= self.sustain:
            baseline = state["baseline"]
            return Finding(
                step,
                title(f"{len(hits)} of the last {len(recent)} steps"),
                SpikeEvidence(
                    key=evidence["key"],
                    steps=[r[0] for r in hits],
                    values=[r[2] for r in hits],
                    onset_step=hits[0][0],
                    baseline_median=evidence["baseline_median"],
                    baseline_steps=[baseline[0][0], baseline[-1][0]],
                    ratio=evidence["ratio"],
                    z=evidence["z"],
                ),
            )
        return CLEAR if not hits else None


class GradNormSpike(_SustainedSpike[SpikeState]):
    name = "grad_norm_spike"
    description = (
        "The global gradient norm jumped and stays up: on at least `sustain` of the last 5 applied steps the "
        "robust z-score of log10(norm) against the median/MAD of the `window` steps before was at least `z` "
        "and the norm at least `min_ratio`x that median and well clear of the window's 98th percentile (a "
        "single odd batch is not a divergence, nor are outlier batches the run has had all along)."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(100, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps"),
        "warmup": Param(
            20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps needed before judging"
        ),
        "z": Param(6.0, minimum=0.0, exclusive_minimum=True),
        "min_ratio": Param(10.0, minimum=1.0),
        "sustain": Param(3, minimum=1, maximum=RECENT, integer=True, doc=f"of the last {RECENT} steps"),
    }
    scalar_keys = frozenset({"grad/global_norm"})
    MIN_SPREAD = 0.01  # log10 units (~2%): a perfectly flat baseline must not make every wiggle a spike

    def initial_state(self) -> SpikeState:
        return {"baseline": [], "recent": []}  # baseline: [step, log10 norm]; recent: [step, hit, norm]

    def observe(self, state: SpikeState, data: StepData, layers: list[str]) -> Verdict:
        norm = data.scalars.get("grad/global_norm")
        if not _finite(norm) or norm <= 0 or data.scalars.get("amp/skipped", 0.0) >= 0.5:
            return None
        x = math.log10(norm)
        baseline = state["baseline"]
        verdict: Verdict = None
        if len(baseline) >= self.warmup:
            # The baseline excludes the latest RECENT steps, so a sustained rise does not hide itself.
            median, spread, tail = _baseline_stats(state, data.step, baseline)
            spread = max(spread, self.MIN_SPREAD)
            z = (x - median) / spread
            ratio = 10 ** (x - median)
            verdict = self._sustained(
                state,
                data.step,
                z >= self.z and ratio >= self.min_ratio and _beyond_tail(x, median, tail),
                norm,
                lambda seen: (
                    f"gradient norm {norm:.3g} is {_times(ratio)} its running median {10**median:.3g} "
                    f"(z={z:.1f}; {seen})"
                ),
                {"key": "grad/global_norm", "baseline_median": 10**median, "ratio": ratio, "z": z},
            )
        _append_bounded(baseline, [data.step, x], self.window)
        return verdict


class LossSpike(_SustainedSpike[LossSpikeState]):
    name = "loss_spike"
    description = (
        "The loss rose and stays up: on at least `sustain` of the last 5 steps it was at least `min_ratio`x "
        "the median of the `window` steps before, `z` robust deviations above it and well clear of the "
        "window's 98th percentile (outlier batches the run has had all along are not a divergence). Warm-up "
        "(a falling loss) is never a spike; within `restart_grace` steps of the lr rising back to a level "
        "the run used before (a scheduled restart) only a loss above the run's starting loss counts."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(100, minimum=10, maximum=MAX_WINDOW, integer=True, doc="baseline steps"),
        "warmup": Param(
            20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps needed before judging"
        ),
        "z": Param(8.0, minimum=0.0, exclusive_minimum=True),
        "min_ratio": Param(2.0, minimum=1.0, doc="loss / baseline median (for a positive loss)"),
        "sustain": Param(3, minimum=1, maximum=RECENT, integer=True, doc=f"of the last {RECENT} steps"),
        "restart_grace": Param(
            200, minimum=0, maximum=MAX_STEPS, integer=True, doc="steps after a scheduled lr restart"
        ),
    }
    scalar_keys = frozenset({*LOSS_KEYS, "lr"})

    def initial_state(self) -> LossSpikeState:
        return {
            "baseline": [],
            "recent": [],
            "start_loss": None,
            "lr": None,
            "lr_max": None,
            "grace_until": -1,
        }

    def _track_lr(self, state: LossSpikeState, data: StepData) -> None:
        lr = data.scalars.get("lr")
        if not _finite(lr):
            return
        previous, peak = state["lr"], state["lr_max"]
        if _finite(previous) and previous > 0 and lr > 2 * previous and _finite(peak) and lr <= 1.5 * peak:
            state["grace_until"] = data.step + self.restart_grace  # back to a level used before: a restart
        state["lr"] = lr
        state["lr_max"] = lr if peak is None else max(peak, lr)

    def observe(self, state: LossSpikeState, data: StepData, layers: list[str]) -> Verdict:
        self._track_lr(state, data)
        loss = _loss_of(data)
        if loss is None or not math.isfinite(loss[1]):
            return None  # non-finite losses are loss_non_finite's
        key, value = loss
        baseline = state["baseline"]
        if len(baseline) < self.warmup:
            state["start_loss"] = value if state["start_loss"] is None else max(state["start_loss"], value)
        verdict: Verdict = None
        if len(baseline) >= self.warmup:
            median, spread, tail = _baseline_stats(state, data.step, baseline)
            spread = max(spread, 0.01 * abs(median), 1e-8)
            z = (value - median) / spread
            ratio_ok = value >= self.min_ratio * median if median > 0 else z >= 2 * self.z
            hit = z >= self.z and ratio_ok and _beyond_tail(value, median, tail)
            if hit and data.step <= state["grace_until"]:
                hit = state["start_loss"] is not None and value > state["start_loss"]
            ratio = value / median if median > 0 else None

            def title(seen: str) -> str:
                size = (
                    f"{_times(ratio)} its running median"
                    if ratio is not None
                    else f"{z:.3g} deviations above its median"
                )
                return f"{key} {value:.4g} is {size} {median:.4g} ({seen})"

            verdict = self._sustained(
                state,
                data.step,
                hit,
                value,
                title,
                {"key": key, "baseline_median": median, "ratio": ratio, "z": z},
            )
        _append_bounded(baseline, [data.step, value], self.window)
        return verdict


class LrJump(RuleType[LrJumpState]):
    name = "lr_jump"
    family = "divergence"
    description = (
        "The learning rate jumped at least `factor`x in one step to at least twice the highest value the run "
        "had used (a scheduler or config bug; warm-up and restarts to an earlier level do not count). Judged "
        "after `warmup` steps of lr history; resolves when the lr is back within twice the earlier peak."
    )
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(30.0, minimum=1.0, exclusive_minimum=True, doc="lr(step) / lr(step - 1)"),
        "warmup": Param(10, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps of lr history needed"),
    }
    scalar_keys = frozenset({"lr"})
    cooldown_steps = 0

    def initial_state(self) -> LrJumpState:
        return {"count": 0, "lr": None, "peak": None, "jump": None}  # jump: [step, from, to, peak before]

    def observe(self, state: LrJumpState, data: StepData, layers: list[str]) -> Verdict:
        lr = data.scalars.get("lr")
        if not _finite(lr):
            return None
        previous, peak = state["lr"], state["peak"]
        state["lr"] = lr
        state["count"] += 1
        state["peak"] = lr if peak is None else max(peak, lr)
        jump = state["jump"]
        if jump is not None:
            if lr <= 2 * jump[3]:
                state["jump"] = None
                return CLEAR
            return None
        if state["count"] <= self.warmup or not (_finite(previous) and previous > 0 and peak):
            return None
        if lr < self.factor * previous or lr < 2 * peak:
            return None
        state["jump"] = [data.step, previous, lr, peak]
        return Finding(
            data.step,
            f"the learning rate jumped {_times(lr / previous)} at step {data.step} ({previous:.3g} -> "
            f"{lr:.3g}; the run's highest before was {peak:.3g})",
            LrJumpEvidence(
                key="lr",
                steps=[data.step - 1, data.step],
                values=[previous, lr],
                ratio=lr / previous,
                previous_peak=peak,
            ),
        )


def undivided_loss_ratio(micro_batches: float, min_ratio: float, share: float) -> float:
    """The median pre-clip norm / max_norm from which saturated clipping over `micro_batches` backward
    passes a step names an undivided (summed) loss: max(min_ratio, share x micro_batches).

    An undivided loss makes the accumulated gradient micro_batches times what the divided one is, so its
    norm sits about micro_batches times above where the run would clip otherwise; a correctly divided
    run that clips sits at 1-2x max_norm in early training (nanoGPT: loss / 8, clip 1.0, ~1.35x), which
    must never be told as a summed loss. Below this ratio the evidence cannot tell the two apart."""
    return max(min_ratio, share * micro_batches)


class ClipSaturation(RuleType[ClipSaturationState]):
    name = "clip_saturation"
    family = "stalled"
    description = (
        "clip_grad_norm_ cuts the gradient on nearly every step. With gradient accumulation over k micro-"
        "batches, an undivided loss: of the last `window` applied steps at least `fraction` clipped with a "
        "median norm/max_norm of at least max(`min_ratio_accumulating`, `undivided_share` x k) (an "
        "undivided loss makes the norm k times the divided one's; a divided loss that clips sits near "
        "1-2x). Otherwise the clip sets the step size: the same over `plain_window` steps at a median of at "
        "least `min_ratio` (early training often clips at a modest ratio for a while: no finding)."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="applied steps, accumulating"),
        "plain_window": Param(
            200, minimum=5, maximum=MAX_WINDOW, integer=True, doc="applied steps, otherwise"
        ),
        "fraction": Param(0.9, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        "min_ratio": Param(3.0, minimum=1.0),
        "min_ratio_accumulating": Param(3.0, minimum=1.0),
        "undivided_share": Param(
            0.5, minimum=0.0, maximum=1.0, doc="share of the micro-batch count the median ratio must reach"
        ),
    }
    scalar_keys = frozenset({"grad/global_norm", "grad/clip_max_norm", "amp/micro_batches"})

    def initial_state(self) -> ClipSaturationState:
        # recent: [step, norm / max_norm] of the latest max(window, plain_window) applied steps, oldest
        # first; ordered / short: the ratios of the latest plain_window / window of them, sorted, so that
        # the share clipped and the median cost O(log window) per step.
        return {"recent": [], "ordered": [], "short": [], "micro_batches": 1}

    def observe(self, state: ClipSaturationState, data: StepData, layers: list[str]) -> Verdict:
        micro = data.scalars.get("amp/micro_batches")
        if _finite(micro):
            state["micro_batches"] = micro
        norm, max_norm = data.scalars.get("grad/global_norm"), data.scalars.get("grad/clip_max_norm")
        if (
            not (_finite(norm) and _finite(max_norm) and max_norm > 0)
            or data.scalars.get("amp/skipped", 0) >= 0.5
        ):
            return None
        recent, ratio = state["recent"], norm / max_norm
        ordered, short = state.get("ordered"), state.get("short")
        if (
            ordered is None
            or short is None
            or len(ordered) != min(len(recent), self.plain_window)
            or len(short) != min(len(recent), self.window)
        ):
            # A state from before "ordered" or "short" existed, or the windows changed.
            ordered = state["ordered"] = sorted(r[1] for r in recent[-self.plain_window :])
            short = state["short"] = sorted(r[1] for r in recent[-self.window :])
        recent.append([data.step, ratio])
        for ratios, window in ((ordered, self.plain_window), (short, self.window)):
            bisect.insort(ratios, ratio)
            if len(ratios) > window:  # the ratio that left this window
                del ratios[bisect.bisect_left(ratios, recent[-window - 1][1])]
        del recent[: max(len(recent) - max(self.window, self.plain_window), 0)]
        micro_batches = state["micro_batches"]
        undivided = (
            self._saturated(
                short,
                self.window,
                undivided_loss_ratio(micro_batches, self.min_ratio_accumulating, self.undivided_share),
            )
            if micro_batches > 1
            else None
        )
        plain = self._saturated(ordered, self.plain_window, self.min_ratio)
        if not (undivided or plain):
            cleared = [s for s in (undivided, plain) if s is not None]
            return CLEAR if cleared and all(s is False for s in cleared) else None
        window = self.window if undivided else self.plain_window
        ratios = short if undivided else ordered
        share = (len(ratios) - bisect.bisect_right(ratios, 1.0)) / len(ratios)
        median = _median_of_sorted(ratios)
        return Finding(
            data.step,
            f"clipping cut the gradient on {share:.0%} of the last {window} steps: the pre-clip norm is "
            f"{median:.3g}x max_norm={max_norm:g} (median)"
            + (f", with {micro_batches:g} micro-batches per step" if micro_batches > 1 else ""),
            ClipSaturationEvidence(
                key="grad/global_norm",
                steps=[recent[-window][0], data.step],
                fraction_clipped=share,
                median_ratio=median,
                max_norm=max_norm,
                micro_batches=micro_batches,
                undivided_loss=bool(undivided),
            ),
            cause="clip_saturation_accumulation" if undivided else "",
        )

    def _saturated(self, ratios: list[float], window: int, threshold: float) -> bool | None:
        """True: a full window, at least `fraction` of it clipped at a median of at least `threshold`;
        False: under half of `fraction` clipped (clear); None: neither (or the window is not full)."""
        if len(ratios) < window:
            return None
        share = (len(ratios) - bisect.bisect_right(ratios, 1.0)) / len(ratios)
        if share >= self.fraction and _median_of_sorted(ratios) >= threshold:
            return True
        return False if share < self.fraction / 2 else None
