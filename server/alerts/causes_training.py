"""The causes in the optimisation, the data and the setup: params not in the optimizer, a burst that
passed, an lr ramp or jump and the divergence it starts, a NaN loss from the data, an update-ratio
outlier layer, saturated clipping, dead layers, weights that stop changing."""

from __future__ import annotations

from collections.abc import Sequence

from . import advice
from .diagnosis_context import (
    ByRule,
    Findings,
    Misuse,
    Result,
    RunContext,
    _divergence_trigger,
    _layers,
    _lr_at,
    _named,
    _non_finite,
    _onset,
    _x,
    finding_onset,
    lr_jump_near,
    lr_ramp_near,
)
from .evidence import (
    ClipSaturationEvidence,
    DeadLayersEvidence,
    LossDivergenceEvidence,
    LossNonFiniteEvidence,
    MisuseEvidence,
    NotLearningEvidence,
    SpikeEvidence,
    UpdateRatioOutlierEvidence,
)
from .rules.misuse import share, unheld_parameters_title

# The findings that say training diverges: a spike of the gradient norm or of the loss, or the loss out
# of the range it had reached (loss_divergence: a climb too slow for the spikes, finite or not).
_DIVERGING = ("grad_norm_spike", "loss_spike", "loss_divergence")
# A stalled layer whose gradient norm is at most this share of the largest layer's gets no gradient to
# speak of: the gradient vanished through depth (fp32 rounds an update away only below ~6e-8 of the
# weight, which an Adam step of lr ~1e-3 reaches only with such a gradient).
VANISHED_SHARE = 1e-6
TRANSIENT_SPAN = 50  # steps from a burst's first finding to its last: a longer one is not a burst
_WINDOWED_RULES = frozenset({"skip_storm", "scale_drop"})
# The rules whose findings a burst that passes can raise (a setup mistake, an lr jump, stalled layers or
# a scaler that never settles are not bursts, whatever happens after).
_BURST_RULES = frozenset(
    {"loss_non_finite", "non_finite", "skip_storm", "scale_drop", "grad_norm_spike", "loss_spike"}
)


def _params_not_in_optimizer(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """Layers with a gradient that no param group holds (the agent's params_not_in_optimizer): the
    cause when the incident holds nothing it does not explain (their layers are not watched, so no
    other rule sees them)."""
    finding = by_rule.get("misuse")
    if finding is None:
        return None
    evidence: MisuseEvidence = finding["evidence"]
    details = evidence.get("details") or {}
    unheld = details.get("params_not_in_optimizer") if isinstance(details, dict) else None
    if not isinstance(unheld, dict) or set(by_rule) - {"misuse", "update_ratio_outlier", "update_ratio"}:
        return None
    layers = [str(name) for name in unheld.get("layers") or []]
    count = unheld.get("count") if isinstance(unheld.get("count"), int) else len(layers)
    fraction = unheld.get("fraction")
    weights = (
        f" ({share(fraction)} of the weights that get a gradient)"
        if isinstance(fraction, (int, float))
        else ""
    )
    return (
        "params_not_in_optimizer",
        unheld_parameters_title(unheld),
        (
            f"{count} layers{weights} get a gradient on every step but are in no param group of the "
            f"optimizer ({_named(layers)}), so they never change: the optimizer was built from part of the "
            "parameters (the head only, or before the backbone was unfrozen)."
        ),
        advice.params_not_in_optimizer_steps(),
        layers,
    )


def _transient(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    """A burst (non-finite losses, overflows the scaler skipped, a spike) over at most TRANSIENT_SPAN
    steps, after which every rule that fired has cleared by itself: a burst that passed, described as one
    rather than as a lasting cause to act on (the demo's injected activation blow-up; a few bad batches)."""
    recovered = context.recovered_step
    if recovered is None or not set(by_rule) <= _BURST_RULES:
        return None
    if "non_finite" in by_rule and _non_finite(by_rule["non_finite"]).get("applied"):
        return None  # non-finite gradients reached the weights: nothing a run recovers from by itself
    first = min(finding_onset(f) for f in findings)
    # skip_storm and scale_drop hold as long as their window still shows the burst (and scale_drop while
    # the scale stays low: it grows back every growth_interval): when they fired is the burst's
    last = max(
        f["step"] if f["rule"] in _WINDOWED_RULES else max(f.get("last_step") or f["step"], f["step"])
        for f in findings
    )
    if last - first > TRANSIENT_SPAN or _divergence_trigger(by_rule, context, first) is not None:
        return None
    what = []
    if "loss_non_finite" in by_rule:
        what.append("non-finite losses")
    if {"skip_storm", "scale_drop", "non_finite"} & set(by_rule):
        what.append(
            "overflowing gradients the GradScaler skipped" if context.fp16_scaler else "non-finite gradients"
        )
    if {"grad_norm_spike", "loss_spike"} & set(by_rule):
        what.append(
            " and ".join(
                w for r, w in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss")) if r in by_rule
            )
            + " far above the run's median"
        )
    span = f"steps {first}-{last}" if last > first else f"step {first}"
    return (
        "transient_burst",
        f"a transient burst at {span} ({'; '.join(what)}); training recovered by step {recovered}",
        (
            f"For {last - first + 1} step{'s' if last > first else ''} ({span}) the run showed "
            f"{'; '.join(what)}, and every rule that fired has cleared since (by step {recovered}): a burst "
            "that passed, such as a few bad batches or a transient activation spike, not a lasting problem."
        ),
        advice.transient_burst_steps(),
    )


def _ramp(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    """The lr ramped up (a warm-up to a peak far too high) and the loss rose with it, then the run
    broke (a NaN loss, overflows, a spike): the schedule's peak is the cause, not the data or fp16."""
    if "lr_jump" in by_rule or lr_jump_near(
        context.lr, step, peak_before=context.lr_peak_before, points_before=context.lr_points_before
    ):
        return None  # one step's jump: _divergence names it
    ramp = lr_ramp_near(context.lr, context.loss, step)
    if ramp is None:
        return None
    low_at, low, high_at, high, rise = ramp
    return (
        "lr_ramp",
        (
            f"the learning rate ramped {_x(high / low)}x to {high:.3g} by step {high_at} and the loss rose "
            f"{_x(rise)}x: the peak lr is too high"
        ),
        (
            f"The learning rate rose from {low:.3g} at step {low_at} to {high:.3g} at step {high_at} and the "
            f"loss rose {_x(rise)}x over the same steps before the run broke at step {step}: a warm-up (or "
            "schedule) whose peak learning rate is too high for this model, not the data or fp16's range."
        ),
        advice.lr_ramp_steps(high, low_at),
    )


def _bad_loss(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("loss_non_finite")
    if finding is None:
        return None
    evidence: LossNonFiniteEvidence = finding["evidence"]
    nan_step = int(evidence.get("first_step", finding["step"]))
    spikes = _onset(by_rule, _DIVERGING)
    if _divergence_trigger(by_rule, context, nan_step) is not None or (
        spikes is not None and spikes < nan_step
    ):
        return None  # a divergence that ended in NaN: _divergence explains it
    ids = evidence.get("batch_ids") or []
    value = (evidence.get("values") or ["NaN"])[0]
    batch = f" on batch {', '.join(map(str, ids[:10]))}" if ids else ""
    applied = any(f["rule"] == "non_finite" and _non_finite(f).get("applied") for f in findings)
    steps = advice.bad_loss_steps(ids, nan_step, applied, context.fp16_scaler)
    return (
        "loss_non_finite",
        f"the loss is {value} at step {nan_step}{batch}",
        (
            f"The loss itself was {value} at step {nan_step}{batch}: the forward pass or the data produced "
            "it, not an overflow of the gradients that the GradScaler could cure."
        ),
        steps,
    )


def _update_ratio_outlier(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """One layer's update ratio far above every other layer's: most likely its param group's lr."""
    finding = by_rule.get("update_ratio_outlier")
    if finding is None:
        return None
    evidence: UpdateRatioOutlierEvidence = finding["evidence"]
    layers = [str(name) for name in evidence.get("layers") or []]
    factors: Sequence[float | None] = evidence.get("factors") or [None]
    values: Sequence[float | None] = evidence.get("values") or [None]
    median, at = evidence.get("median"), finding["step"]
    if not layers or not isinstance(values[0], (int, float)) or not isinstance(median, (int, float)):
        return None
    layer, factor = layers[0], _x(factors[0])
    count = evidence.get("count") if isinstance(evidence.get("count"), int) else len(layers)
    more = f" (and {count - 1} more layer{'s' if count > 2 else ''})" if count > 1 else ""
    follows = [
        what
        for rule, what in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss"))
        if rule in by_rule
    ]
    return (
        "update_ratio_outlier",
        f"the update ratio of {layer} is {factor}x the median layer's: its learning rate is likely {factor}x "
        "the others'" + more,
        (
            f"At step {at} one optimizer step changed {layer} by {values[0]:.3g} of its norm, the median "
            f"layer by {median:.3g} ({factor}x less){more}. Most likely the param group holding {layer} has "
            f"a learning rate ~{factor}x the others' (a typo in its lr, a multiplier applied twice); less "
            "likely "
            f"its weights were initialised ~{factor}x smaller than the others'. Its ratio evens out within a "
            "few dozen steps as its weights grow, while its learning rate stays wrong"
            + (f"; the {' and '.join(follows)} spikes here follow from it." if follows else ".")
        ),
        advice.update_ratio_outlier_steps(layer, factor, at),
        layers,
    )


def _divergence_ahead(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """A divergence_warning with nothing broken yet: the precursors, and what to do before it breaks."""
    finding = by_rule.get("divergence_warning")
    if finding is None or set(by_rule) & {"loss_divergence", "loss_non_finite", "lr_jump", "non_finite"}:
        return None  # something broke: _divergence or the others name it
    evidence: LossDivergenceEvidence = finding["evidence"]
    steps = evidence.get("steps") or []
    best = steps[0] if steps else finding["step"]
    precursors = list(evidence.get("precursors") or [])
    for rule, what in (("grad_norm_spike", "the gradient norm"), ("loss_spike", "the loss")):
        if rule in by_rule:  # the spike rules' warnings join it: more evidence of the same climb
            spike: SpikeEvidence = by_rule[rule]["evidence"]
            precursors.append(f"{what} is {_x(spike.get('ratio'))}x its running median")
    seen = "; ".join(precursors) if precursors else "the loss is climbing"
    if evidence.get("key") == "lr":
        what = (
            f"The learning rate rose past the peak the run had settled on ({_x(evidence.get('ratio'))}x "
            f"it at step {finding['step']}): a restart or schedule with a mistyped peak. Nothing has "
            "broken yet; runs whose lr passes their stable peak this way usually diverge within tens of "
            "steps."
        )
    else:
        values = evidence.get("values") or [0.0, 0.0]
        what = (
            f"The loss is climbing ({_x(evidence.get('ratio'))}x its best level {values[0]:.4g} at step "
            f"{best}) while {seen}: the precursors of a divergence (an lr too high for this point of "
            "training)."
        )
    return (
        "divergence_warning",
        f"divergence ahead: {seen} (best step {best})",
        what,
        advice.divergence_warning_steps(finding_onset(finding)),
    )


def _divergence(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    spikes = _onset(by_rule, _DIVERGING)
    trigger = _divergence_trigger(by_rule, context, step if spikes is None else max(step, spikes))
    if trigger is None and spikes is None:
        return None
    if trigger is None and not (set(_DIVERGING) & set(by_rule)):
        return None
    symptoms = []
    for rule, what in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss")):
        if rule in by_rule:
            spike: SpikeEvidence = by_rule[rule]["evidence"]
            symptoms.append(f"{what} {_x(spike.get('ratio'))}x its running median")
    if "loss_divergence" in by_rule:
        left: LossDivergenceEvidence = by_rule["loss_divergence"]["evidence"]
        steps = left.get("steps") or []
        best = steps[0] if steps else "?"
        symptoms.append(
            f"the loss {_x(left.get('ratio'))}x its best level (step {best}), out of its range"
            + "".join(f", {p}" for p in left.get("precursors") or [])
        )
    if any(r in by_rule for r in ("skip_storm", "scale_drop", "scaler_calibration")):
        symptoms.append("fp16 overflows that make the scaler skip steps")
    if "loss_non_finite" in by_rule:
        loss: LossNonFiniteEvidence = by_rule["loss_non_finite"]["evidence"]
        symptoms.append(f"a {loss.get('values', ['NaN'])[0]} loss")
    since = " (" + "; ".join(symptoms) + ")" if symptoms else ""
    if trigger is not None:
        at, before, after = trigger
        rewind = at
        good_lr: float | None = before
        cause = (
            f"The learning rate jumped {_x(after / before)}x at step {at} ({before:.3g} -> {after:.3g}): a "
            f"scheduler or config bug, and the run diverges since{since}."
        )
        title = f"the learning rate jumped {_x(after / before)}x at step {at}; the run diverges"
        jump: tuple[int, str] | None = (at, _x(after / before))
    else:
        rewind = spikes if spikes is not None else step
        good_lr = _lr_at(context, rewind)
        announced = by_rule.get("divergence_warning")
        start = finding_onset(announced) if announced is not None else rewind
        lr_before = _lr_at(context, start - 1) or good_lr
        peak = max((lr for s, lr in context.lr if s >= start), default=None)
        if lr_before and peak and peak >= 2 * lr_before:  # a ramp since the warning: not "lr unchanged"
            rewind = min(rewind, start)
            return (
                "divergence",
                (
                    f"the learning rate rose {_x(peak / lr_before)}x from step {start} ({lr_before:.3g} -> "
                    f"{peak:.3g}); the run diverges"
                ),
                (
                    f"From step {start} the learning rate rose {_x(peak / lr_before)}x to {peak:.3g} (a "
                    f"restart or schedule whose peak is too high) and training diverges since{since}."
                ),
                advice.divergence_steps(None, lr_before, rewind),
            )
        warm_up = _warming_up(context, start)
        if warm_up is not None:  # the lr is still rising at the onset: not "unchanged"
            ramp_from, lr_then = warm_up
            rewind = min(rewind, start)
            return (
                "divergence",
                f"training diverges from step {start} while a warm-up raises the lr ({lr_then:.3g})",
                (
                    f"From step {start} training diverges while a warm-up is still raising the learning "
                    f"rate ({ramp_from:.3g} {WARM_UP_SPAN} steps before, {lr_then:.3g} then): the ramp is "
                    f"too fast or its peak too high for this model at this point{since}."
                ),
                advice.warm_up_divergence_steps(lr_then, rewind),
            )
        lr_now = f" ({good_lr:.3g})" if good_lr else ""
        # With the lr unchanged, the evidence so far fits two causes: which one tells itself in the next
        # steps (a burst clears, and the incident is then updated; a divergence stays up).
        cause = (
            f"Training diverges from step {rewind}{since}, with no change of the learning rate before it. "
            f"Two causes fit, the likelier first: the learning rate{lr_now} is too high for this point, if "
            "the loss stays up; or a burst that passes (a few bad batches, activations past fp16's range), "
            "if the loss is back near its median within ~50 steps."
        )
        title = f"training diverges from step {rewind} (learning rate unchanged), or a burst"
        jump = None
    return (
        "divergence" if trigger is None else "lr_jump",
        title,
        cause,
        advice.divergence_steps(jump, good_lr, rewind),
    )


WARM_UP_SPAN = 30  # steps over which an lr that rose 1.5x to the run's highest yet is a warm-up in progress


def _warming_up(context: RunContext, step: int) -> tuple[float, float] | None:
    """(lr WARM_UP_SPAN steps before `step`, lr at `step`) when the lr rose at least 1.5x over those steps
    to the highest the run had had: a warm-up still ramping where the divergence began."""
    before, now = _lr_at(context, step - WARM_UP_SPAN), _lr_at(context, step)
    if not (before and now) or now < 1.5 * before:
        return None
    highest = max((lr for s, lr in context.lr if s <= step), default=now)
    return (before, now) if now >= 0.99 * highest else None


def _clipping(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("clip_saturation")
    if finding is None:
        return None
    evidence: ClipSaturationEvidence = finding["evidence"]
    median, max_norm = evidence.get("median_ratio", 0.0), evidence.get("max_norm", 0.0)
    micro = evidence.get("micro_batches") or context.micro_batches or 1
    clipped = f"{evidence.get('fraction_clipped', 1):.0%}"
    if evidence.get("undivided_loss") and micro > 1:
        k, ratio = f"{micro:g}", f"{median:.3g}x"
        return (
            "clip_saturation_accumulation",
            f"clipping fires on every step at {ratio} max_norm: the loss is summed over {k} micro-batches",
            (
                f"Clipping cuts the gradient on {clipped} of steps, the pre-clip norm {median:.3g}x "
                f"max_norm={max_norm:g} (median), with {k} micro-batches per optimizer step: a loss not "
                f"divided by {k} makes the gradient {k}x what the divided one is, which fits this (divided, "
                f"it would be ~{median / micro:.2g}x max_norm); so the clip, not the lr, sets every step."
            ),
            advice.clip_saturation_accumulation_steps(k, max_norm),
        )
    accumulation = (
        f" With {micro:g} micro-batches a step, an undivided loss would put the norm ~{micro:g}x above "
        "where a divided one clips; this ratio does not show that."
        if micro > 1
        else ""
    )
    return (
        "clip_saturation",
        f"clipping fires on nearly every step at {median:.3g}x max_norm",
        (
            f"Clipping cuts the gradient on {clipped} of steps (pre-clip norm {median:.3g}x "
            f"max_norm={max_norm:g}, median) for a long stretch: the clip, not the learning rate, sets the "
            f"step size.{accumulation}"
        ),
        advice.clip_saturation_steps(median * max_norm),
    )


def _dead(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("dead_layers")
    if finding is None:
        return None
    evidence: DeadLayersEvidence = finding["evidence"]
    layers = [str(n) for n in evidence.get("layers") or []]
    count = evidence.get("count") if isinstance(evidence.get("count"), int) else len(layers)
    none = evidence.get("grad_none") or []
    if none:
        cause = (
            f"{count} trainable layers get no gradient at all (grad is None): a .detach(), "
            f"torch.no_grad() or an unused branch cuts {_named(layers, total=count)} off the loss, so they "
            "never train."
        )
    else:
        cause = (
            f"{count} trainable layers get a gradient of exactly zero on every step "
            f"({_named(layers, total=count)}): a multiplication by zero, dead ReLUs or a zero-initialised "
            "layer after them" + (", or gradients underflowing in fp16" if context.fp16_scaler else "") + "."
        )
    return (
        "dead_layers",
        f"no gradient reaches {_named(layers, total=count)}",
        cause,
        advice.dead_layers_steps(layers[0] if layers else None),
    )


def _stalled(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("not_learning")
    if finding is None:
        return None
    layers = _layers(findings, "not_learning")
    lr = _lr_at(context, finding["step"])
    if lr == 0:
        return (
            "lr_zero",
            "the learning rate is 0: no weight changes",
            (
                f"The learning rate is 0 at step {finding['step']}, so the optimizer changes no weight (a "
                "scheduler that decays to 0 or starts there for too long)."
            ),
            advice.lr_zero_steps(),
        )
    stalled: NotLearningEvidence = finding["evidence"]
    shares = [v for v in stalled.get("grad_norm_shares") or [] if isinstance(v, (int, float))]
    top = stalled.get("top_grad_layer")
    if shares and top and max(shares) <= VANISHED_SHARE:
        return (
            "vanishing_gradients",
            f"gradients vanish through depth: {_named(layers)} get ~{max(shares):.0e} of {top}'s gradient",
            (
                f"Weights of {_named(layers)} stop changing because almost no gradient reaches them: their "
                f"gradient norms are at most {max(shares):.1e} of {top}'s at step {finding['step']}, so each "
                "update is far below the weights' precision and rounds away. The gradient shrinks on its way "
                "down the stack (saturating sigmoid/tanh activations, no residual connections or "
                "normalisation, a poor initialisation), not because the weights are stored in low precision."
            ),
            advice.vanishing_gradients_steps(),
        )
    values = stalled.get("values") or []
    share = f"{values[0]:.0%} of " if values and isinstance(values[0], (int, float)) else ""
    return (
        "rounded_away",
        f"weights of {_named(layers)} stop changing: updates round away",
        f"Weights of {_named(layers)} stop changing: {share}their updates are rounded away, as happens when "
        "weights are stored in bf16/fp16 and an update is below half an ulp of the weight"
        + (f" (lr {lr:.3g})" if lr else "")
        + ".",
        advice.rounded_away_steps(),
    )
