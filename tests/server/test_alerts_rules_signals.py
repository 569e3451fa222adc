"""The rules that read the training signals, as pure functions of steps: gradient norm, loss and lr
divergence, clipping, the per-layer rules (underflow, dead layers, not learning, update ratio) and rank
disagreement; and what every rule type must do: validate its parameters, keep its state through JSON
and survive odd input.
"""

import json
import math

import pytest
from rule_steps import LAYERS, Scaler, feed, findings_of, first_finding, scalar_steps

from gradwatch.server.alerts.rules import CLEAR, DEFAULT_RULES, RULE_TYPES, Finding, StepData, make_rule

# -- parameters ------------------------------------------------------------------------------------


def test_every_default_is_a_known_type_and_defaults_validate():
    assert set(DEFAULT_RULES) <= set(RULE_TYPES)
    assert {"scaler_calibration", "scale_drop", "skip_storm", "non_finite", "loss_non_finite"} <= set(
        DEFAULT_RULES
    )
    for name in RULE_TYPES:
        make_rule(name)


@pytest.mark.parametrize(
    ("rule_type", "params", "message"),
    [
        ("nope", {}, "unknown rule type 'nope'"),
        ("scale_drop", {"factor": 1}, "factor must be greater than 1"),
        ("scale_drop", {"window": 2.5}, "window must be a whole number"),
        ("scale_drop", {"windw": 5}, "unknown parameter 'windw'"),
        ("skip_storm", {"count": 20, "window": 10}, "count (20) cannot exceed window (10)"),
        ("update_ratio", {"low": 1, "high": 0.5}, "low (1) must be below high (0.5)"),
        ("underflow", {"threshold": 2}, "threshold must be at most 1"),
        ("underflow", {"all_zero": 1}, "all_zero must be true or false"),
        ("scale_floor", {"floor": "x"}, "floor must be a number"),
        # Bounded state and work per point, whatever a project configures.
        ("grad_norm_spike", {"window": 1_000_000_000}, "window must be at most 10000"),
        ("rank_disagreement", {"window": 10**7}, "window must be at most 10000"),
        ("loss_non_finite", {"clear_after": 10**9}, "clear_after must be at most 1e+06"),
        ("scaler_calibration", {"settle_steps": 5}, "settle_steps must be at least 10"),
        ("grad_norm_spike", {"warmup": 50, "window": 20}, "warmup (50) cannot exceed window (20)"),
        ("grad_norm_spike", {"sustain": 6}, "sustain must be at most 5"),
        ("lr_jump", {"factor": math.inf}, "factor must be finite"),
    ],
)
def test_bad_parameters_are_refused_with_what_is_wrong(rule_type, params, message):
    with pytest.raises((ValueError, TypeError)) as info:
        make_rule(rule_type, params)
    assert message in str(info.value)


# -- divergence: gradient norm, loss, lr -------------------------------------------------------------


def _noisy(n, level=1.0, amplitude=0.2, start=0):
    return [level * (1.0 + amplitude * math.sin(start + i)) for i in range(n)]


def test_one_odd_gradient_norm_is_not_a_finding():
    rule = make_rule("grad_norm_spike", {"window": 30, "warmup": 10})
    norms = [*_noisy(30), 500.0, *_noisy(10, start=31)]
    verdicts, _ = feed(rule, scalar_steps("grad/global_norm", norms))
    assert findings_of(verdicts) == []
    assert verdicts[-1][1] is CLEAR  # once the odd step left the last 5


def test_a_sustained_gradient_norm_rise_is_a_finding_with_its_onset():
    norms = _noisy(60) + [100.0 * x for x in _noisy(10)]
    verdicts, _ = feed(make_rule("grad_norm_spike"), scalar_steps("grad/global_norm", norms))
    step, finding = findings_of(verdicts)[0]
    assert step == 62 and finding.evidence["onset_step"] == 60
    assert finding.evidence["steps"] == [60, 61, 62] and finding.evidence["ratio"] > 50
    assert 0.8 < finding.evidence["baseline_median"] < 1.2


def test_a_gradual_exponential_gradient_norm_growth_fires_within_about_35_steps():
    norms = _noisy(100) + [10 ** (3 * t / 100) for t in range(101)]  # x1000 in 100 steps from step 100
    verdicts, _ = feed(make_rule("grad_norm_spike"), scalar_steps("grad/global_norm", norms))
    step, finding = findings_of(verdicts)[0]
    assert 100 < step <= 140
    assert 100 < finding.evidence["onset_step"] <= step


def test_gradient_norm_spike_ignores_skipped_steps_and_non_finite_norms():
    steps = scalar_steps("grad/global_norm", _noisy(40))
    for step in range(40, 50):
        steps.append(StepData(step, 0, scalars={"grad/global_norm": 1e6, "amp/skipped": 1.0}))
    steps += scalar_steps("grad/global_norm", [math.inf, math.nan, 0.0, -1.0], start=50)
    verdicts, _ = feed(make_rule("grad_norm_spike"), steps)
    assert findings_of(verdicts) == []


def _cosine(step, period, high=1e-3, low=1e-6):
    return low + (high - low) * 0.5 * (1 + math.cos(math.pi * (step % period) / period))


def test_a_falling_warm_up_loss_is_not_a_spike():
    losses = [10.0 * math.exp(-i / 40) + 1.0 + 0.05 * math.sin(i) for i in range(300)]
    verdicts, _ = feed(make_rule("loss_spike"), scalar_steps("loss", losses))
    assert findings_of(verdicts) == []


def test_a_warm_restart_of_a_cosine_schedule_is_not_a_spike():
    """SGDR: at step 300 the lr goes back from eta_min to its first peak; the loss rises ~2.5x for a while,
    still below where the run started."""
    steps = []
    for step in range(600):
        if step < 300:
            loss = 8.0 * math.exp(-step / 30) + 1.0
        else:
            loss = 1.0 + 1.5 * math.exp(-(step - 300) / 40)
        steps.append(
            StepData(step, 0, scalars={"loss": loss * (1 + 0.01 * math.sin(step)), "lr": _cosine(step, 300)})
        )
    verdicts, _ = feed(make_rule("loss_spike"), steps)
    assert findings_of(verdicts) == []
    assert findings_of(feed(make_rule("lr_jump"), steps)[0]) == []


def test_a_diverging_loss_is_a_spike():
    losses = [1.0 + 0.02 * math.sin(i) for i in range(100)] + [5.0 + 0.1 * math.sin(i) for i in range(20)]
    verdicts, _ = feed(make_rule("loss_spike"), scalar_steps("loss", losses))
    step, finding = findings_of(verdicts)[0]
    assert step == 102 and finding.evidence["onset_step"] == 100 and finding.evidence["ratio"] > 4
    assert finding.evidence["key"] == "loss"


def _heavy_tailed(steps, seed, low=0.01, outlier_rate=0.15):
    """A classifier's per-batch loss falling from 1.4 to ~`low`, then 0.2-0.7 on the batches holding
    a hard example (as tests/support/pathologies' bad-sample run has before its NaN)."""
    import random

    rng = random.Random(seed)
    values = []
    for step in range(steps):
        typical = low + 1.4 * math.exp(-step / 15)
        outlier = rng.random() < outlier_rate
        values.append(max(rng.uniform(0.2, 0.7), typical) if outlier else typical * rng.uniform(0.5, 1.5))
    return values


@pytest.mark.parametrize("rule_type", ["loss_spike", "grad_norm_spike"])
def test_outlier_batches_the_run_has_had_all_along_are_not_a_divergence(rule_type):
    """Three such batches in a row (3 of the last 5 steps) happen by chance every few hundred steps;
    they are 30-70x the median but no higher than the run's own outliers before."""
    key = "loss" if rule_type == "loss_spike" else "grad/global_norm"
    for seed in range(20):
        values = _heavy_tailed(2000, seed)
        assert findings_of(feed(make_rule(rule_type), scalar_steps(key, values))[0]) == [], seed
    # ... and a real divergence from such a run is still one: the values leave the run's range.
    values = _heavy_tailed(300, 0) + [5.0 * (1 + 0.1 * math.sin(i)) for i in range(20)]
    step, finding = findings_of(feed(make_rule(rule_type), scalar_steps(key, values))[0])[0]
    assert 302 <= step <= 304 and finding.evidence["onset_step"] >= 300


def test_negative_losses_do_not_crash_and_a_steady_one_is_silent():
    losses = [-100.0 + math.sin(i) for i in range(200)]
    verdicts, _ = feed(make_rule("loss_spike"), scalar_steps("loss", losses))
    assert findings_of(verdicts) == []
    around_zero = [0.01 * math.sin(i) for i in range(100)] + [0.0, -0.0, -1e-9, 1e-9]
    assert findings_of(feed(make_rule("loss_spike"), scalar_steps("loss", around_zero))[0]) == []
    rising = [-100.0 + 0.1 * math.sin(i) for i in range(50)] + [50.0] * 5
    verdicts, _ = feed(make_rule("loss_spike"), scalar_steps("amp/loss", rising))
    step, finding = findings_of(verdicts)[0]  # from -100 to +50: diverging, whatever the sign
    assert step == 52 and finding.evidence["onset_step"] == 50


def test_a_linear_warm_up_is_not_an_lr_jump():
    """LinearLR(start_factor=1e-4, total_iters=5): the first steps rise x2000, x2, x1.5..."""
    lrs = [1e-3 * (1e-4 + (1 - 1e-4) * min(k, 5) / 5) for k in range(300)]
    verdicts, _ = feed(make_rule("lr_jump"), scalar_steps("lr", lrs))
    assert findings_of(verdicts) == []
    exponential = [1e-3 * 100.0 ** (min(k, 3) - 3) for k in range(50)]  # x100 a step for 3 steps
    assert findings_of(feed(make_rule("lr_jump"), scalar_steps("lr", exponential))[0]) == []


def test_a_cosine_warm_restart_is_not_an_lr_jump():
    lrs = [_cosine(step, 200) for step in range(1000)]  # eta_min 1e-6 back to 1e-3 every 200 steps
    assert findings_of(feed(make_rule("lr_jump"), scalar_steps("lr", lrs))[0]) == []


def test_an_lr_jump_far_above_the_peak_fires_at_that_step_and_resolves_when_it_returns():
    lrs = [1e-3] * 200 + [0.3] * 20 + [1e-3] * 5
    verdicts, _ = feed(make_rule("lr_jump"), scalar_steps("lr", lrs))
    findings = findings_of(verdicts)
    assert [s for s, _ in findings] == [200]
    evidence = findings[0][1].evidence
    assert evidence["ratio"] == pytest.approx(300) and evidence["steps"] == [199, 200]
    assert evidence["values"] == [1e-3, 0.3] and evidence["previous_peak"] == 1e-3
    assert [v for s, v in verdicts if s > 200 and s < 220] == [None] * 19
    assert verdicts[220] == (220, CLEAR)


# -- clipping ----------------------------------------------------------------------------------------


def _clip_steps(ratios, max_norm=1.0, **scalars):
    return [
        StepData(i, 0, scalars={"grad/global_norm": r * max_norm, "grad/clip_max_norm": max_norm, **scalars})
        for i, r in enumerate(ratios)
    ]


def test_healthy_clipping_on_some_steps_is_silent():
    ratios = [1.5 if i % 5 == 0 else 0.6 for i in range(200)]
    verdicts, _ = feed(make_rule("clip_saturation"), _clip_steps(ratios))
    assert findings_of(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_clipping_every_step_at_4x_max_norm_fires():
    verdicts, _ = feed(make_rule("clip_saturation"), _clip_steps([4.0] * 250, max_norm=0.5))
    step, finding = findings_of(verdicts)[0]
    assert step == 199  # without accumulation: 200 steps (early training often clips for a while)
    assert finding.evidence["median_ratio"] == 4.0 and finding.evidence["fraction_clipped"] == 1.0
    assert finding.evidence["max_norm"] == 0.5 and finding.cause == ""
    assert findings_of(feed(make_rule("clip_saturation"), _clip_steps([2.5] * 250))[0]) == []  # below 3x


def test_clipping_with_accumulated_micro_batches_names_an_undivided_loss_only_at_about_k_times():
    """nanoGPT divides its loss by 8 micro-batches and clips at 1.0; early on the pre-clip norm sits
    ~1.35x above it: normal, silent. Forgetting the division puts it ~8x higher (10.8x): an undivided loss,
    told within `window` (20) steps."""
    micro = {"amp/micro_batches": 8.0}
    for healthy in (1.35, 1.5, 2.5):  # far below 0.5 x 8 = 4x: divided, it clips as healthy runs do
        assert findings_of(feed(make_rule("clip_saturation"), _clip_steps([healthy] * 300, **micro))[0]) == []
    step, finding = findings_of(feed(make_rule("clip_saturation"), _clip_steps([10.8] * 40, **micro))[0])[0]
    assert step == 19
    assert finding.evidence["micro_batches"] == 8.0 and finding.evidence["undivided_loss"] is True
    assert finding.cause == "clip_saturation_accumulation"
    # 4 micro-batches and clip 0.5 at 1.2-1.5x: silent; undivided (4 x 1.35 = 5.4x): told
    four = {"amp/micro_batches": 4.0}
    ratios = [1.2 + 0.3 * (i % 7) / 6 for i in range(300)]
    assert findings_of(feed(make_rule("clip_saturation"), _clip_steps(ratios, 0.5, **four))[0]) == []
    assert findings_of(feed(make_rule("clip_saturation"), _clip_steps([5.4] * 40, 0.5, **four))[0])


def test_clipping_with_accumulation_at_a_ratio_that_names_no_cause_is_the_plain_finding():
    """6x max_norm with 16 micro-batches for 200 steps: the clip sets the step size, but 6 < 0.5 x 16, so
    the evidence does not name an undivided loss."""
    verdicts, _ = feed(make_rule("clip_saturation"), _clip_steps([6.0] * 250, **{"amp/micro_batches": 16.0}))
    step, finding = findings_of(verdicts)[0]
    assert step == 199 and finding.cause == "" and finding.evidence["undivided_loss"] is False


def test_clipping_skipped_steps_are_not_counted():
    steps = _clip_steps([4.0] * 40, **{"amp/skipped": 1.0})
    assert feed(make_rule("clip_saturation"), steps)[0] == [(s.step, None) for s in steps]


# -- per-layer rules: underflow, dead layers, not learning ------------------------------------------


def test_underflow_fires_when_zeros_and_subnormal_survivors_persist():
    steps = [
        StepData(
            s, 0, vectors={"grad/zero_frac": [0.01, 0.9, 0.0], "grad/precision_loss_frac": [0.0, 0.95, 0.0]}
        )
        for s in (10, 20, 30)
    ]
    verdicts, _ = feed(make_rule("underflow"), steps)
    assert verdicts[0][1] is None
    finding = verdicts[1][1]
    assert isinstance(finding, Finding) and finding.step == 20
    assert finding.evidence["layers"] == ["hidden.weight"] and finding.evidence["values"] == [0.9]
    assert finding.evidence["key"] == "grad/zero_frac" and "hidden.weight" in finding.title


def test_a_sparse_embedding_gradient_is_not_underflow():
    steps = [
        StepData(
            s, 0, vectors={"grad/zero_frac": [0.95, 0.0, 0.0], "grad/precision_loss_frac": [0.0, 0.0, 0.0]}
        )
        for s in range(0, 50, 10)
    ]
    verdicts, _ = feed(make_rule("underflow"), steps)
    assert findings_of(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_a_lora_a_with_an_all_zero_gradient_at_step_zero_is_not_underflow():
    steps = [
        StepData(0, 0, vectors={"grad/zero_frac": [1.0, 0.0], "grad/precision_loss_frac": [math.nan, 0.0]}),
        StepData(1, 0, vectors={"grad/zero_frac": [1.0, 0.0], "grad/precision_loss_frac": [math.nan, 0.0]}),
        StepData(2, 0, vectors={"grad/zero_frac": [0.0, 0.0], "grad/precision_loss_frac": [0.0, 0.0]}),
    ]
    assert findings_of(feed(make_rule("underflow"), steps, layers=("lora_A", "lora_B"))[0]) == []


def test_underflow_by_the_scaled_threshold():
    steps = [StepData(s, 0, vectors={"grad/underflow_frac": [0.0, 0.4]}) for s in (0, 1)]
    finding = first_finding(feed(make_rule("underflow"), steps)[0])
    assert finding.evidence["key"] == "grad/underflow_frac" and finding.evidence["layers"] == [
        "hidden.weight"
    ]


def _norms(step, row, skipped=None):
    scalars = {} if skipped is None else {"amp/skipped": skipped}
    return StepData(step, 0, scalars=scalars, vectors={"grad/norm": row})


def test_a_layer_without_gradient_after_an_applied_step_is_dead():
    steps = [StepData(0, 0, events=[("no_gradient", {"layers": ["head.weight"]})])]
    steps += [_norms(s, [0.5, 0.4, 0.0]) for s in range(6)]
    verdicts, _ = feed(make_rule("dead_layers"), steps)
    findings = findings_of(verdicts)
    step, finding = findings[0]
    assert step == 2  # observations at steps 1 and 2 (step 0 had no applied step before it)
    assert finding.evidence["layers"] == ["head.weight"] and finding.evidence["grad_none"] == ["head.weight"]
    assert finding.cause == "dead_layers_none" and finding.evidence["count"] == 1


def test_a_zero_gradient_without_the_event_is_dead_layers_zero():
    steps = [_norms(s, [0.0, 0.4, 0.3], skipped=0.0) for s in range(5)]
    finding = first_finding(feed(make_rule("dead_layers"), steps)[0])
    assert finding.cause == "dead_layers_zero" and finding.evidence["grad_none"] == []


def test_a_lora_a_with_zero_gradient_at_step_zero_only_is_not_dead():
    steps = [_norms(0, [0.0, 0.3])] + [_norms(s, [0.01, 0.3]) for s in range(1, 20)]
    verdicts, _ = feed(make_rule("dead_layers"), steps, layers=("lora_A", "lora_B"))
    assert findings_of(verdicts) == []


def test_a_lora_a_stays_silent_while_the_scaler_calibrates():
    """17 skipped steps: B is still 0 and so is A's gradient, until the first applied step has run."""
    steps = [_norms(s, [0.0, 0.3], skipped=1.0) for s in range(17)]
    steps.append(_norms(17, [0.0, 0.3], skipped=0.0))  # the first applied step: B=0 still
    steps += [_norms(s, [0.02, 0.3], skipped=0.0) for s in range(18, 40)]
    verdicts, _ = feed(make_rule("dead_layers"), steps, layers=("lora_A", "lora_B"))
    assert findings_of(verdicts) == []
    stuck = [_norms(s, [0.0, 0.3], skipped=1.0 if s < 17 else 0.0) for s in range(40)]
    step, _ = findings_of(feed(make_rule("dead_layers"), stuck, layers=("lora_A", "lora_B"))[0])[0]
    assert step == 19  # observations at 18 and 19, after the first applied step (17)


def _updates(step, rounded=None, ratios=None):
    vectors = {}
    if rounded is not None:
        vectors["update/rounded_away_frac"] = rounded
    if ratios is not None:
        vectors["update/ratio"] = ratios
    return StepData(step, 0, vectors=vectors)


def test_updates_rounded_away_on_two_sampled_steps_are_not_learning():
    steps = [_updates(s, rounded=[0.01, 0.9], ratios=[1e-3, 1e-7]) for s in (100, 200)]
    verdicts, _ = feed(make_rule("not_learning"), steps, layers=("a", "b"))
    assert verdicts[0][1] is None
    finding = verdicts[1][1]
    assert finding.evidence["layers"] == ["b"] and finding.evidence["values"] == [0.9]
    assert (
        finding.evidence["update_ratios"] == [1e-7] and finding.evidence["key"] == "update/rounded_away_frac"
    )


def test_once_rounded_away_is_not_a_stall_and_nan_is_no_gradient():
    steps = [
        _updates(100, rounded=[0.9, math.nan]),
        _updates(200, rounded=[0.01, math.nan]),
        _updates(300, rounded=[0.02, math.nan]),
    ]
    verdicts, _ = feed(make_rule("not_learning"), steps, layers=("a", "b"))
    assert findings_of(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_an_update_ratio_of_zero_without_the_rounded_signal_is_not_learning():
    steps = [_updates(s, ratios=[0.0, 1e-3]) for s in (1, 2)]
    finding = first_finding(feed(make_rule("not_learning"), steps, layers=("a", "b"))[0])
    assert finding.evidence["key"] == "update/ratio" and finding.evidence["layers"] == ["a"]


def test_layer_rules_ignore_skipped_steps_whose_gradients_overflowed():
    """On a skipped step the gradients are inf/NaN or wiped out: zeros there say nothing about a layer."""
    steps = [
        StepData(s, 0, scalars={"amp/skipped": 0.0}, vectors={"grad/norm": [1.0, 1.0]}) for s in range(12)
    ]
    steps += [
        StepData(s, 0, scalars={"amp/skipped": 1.0}, vectors={"grad/norm": [0.0, math.inf]})
        for s in (12, 13, 14)
    ]
    steps += [StepData(15, 0, scalars={"amp/skipped": 0.0}, vectors={"grad/norm": [1.0, 1.0]})]
    verdicts, _ = feed(make_rule("dead_layers"), steps)
    assert not any(isinstance(v, Finding) for _, v in verdicts)
    under = [
        StepData(
            s,
            0,
            scalars={"amp/skipped": 1.0},
            vectors={"grad/zero_frac": [0.9, 0.0], "grad/precision_loss_frac": [1.0, 0.0]},
        )
        for s in (3, 4)
    ]
    verdicts, _ = feed(make_rule("underflow"), under)
    assert not any(isinstance(v, Finding) for _, v in verdicts)


# -- every rule: state through JSON, odd inputs ------------------------------------------------------


def _rich_run():
    """One run that touches every rule: calibration, a sawtooth, a storm, NaN losses, a lr jump, clipping,
    per-layer vectors, events, a second rank."""
    scaler = Scaler(init_scale=2.0**24, growth_interval=15, layers=("hidden.weight", "head.weight"))
    steps = scaler.run("x" * 8 + "." * 40, lr=1e-3, **{"grad/clip_max_norm": 1.0})
    steps += scaler.run("xxxxx" + "." * 10, lr=1e-3)
    steps += scaler.run("xx", loss=math.nan, skipped_norm=math.nan, lr=1e-3)
    steps += scaler.run("." * 40, norm=50.0, lr=0.2, **{"grad/clip_max_norm": 1.0, "amp/micro_batches": 4.0})
    steps += scaler.restore(2.0**10)
    steps += scaler.run("." * 30, lr=1e-3)
    for data in steps:
        if data.step % 5 == 0:
            data.vectors.update(
                {
                    "grad/norm": [0.0, 0.5, math.inf if data.scalars.get("amp/skipped") else 0.3],
                    "grad/zero_frac": [0.95, 0.9, 0.0],
                    "grad/precision_loss_frac": [0.0, 0.95, math.nan],
                    "grad/underflow_frac": [0.0, 0.2],
                    "update/ratio": [0.0, 1e-3, 5e-2],
                    "update/rounded_away_frac": [0.9, math.nan, 0.0],
                }
            )
        if data.step == 3:
            data.events += [
                ("no_gradient", {"layers": ["embed.weight"]}),
                ("clip_before_unscale", {"hint": "h"}),
                ("bad_batch", {"ids_logged": True, "ids": [4, 5]}),
            ]
        if data.step == 70:
            data.events += [
                ("bf16_model_in_fp16", {"max_abs_weight": 1e6}),
                ("bad_batch", {"ids_logged": True, "ids": ["x"]}),
            ]
    others = [
        StepData(
            d.step,
            1,
            scalars={"amp/skipped": 1.0 - d.scalars["amp/skipped"]} if d.step % 7 == 0 else dict(d.scalars),
        )
        for d in steps
        if "amp/skipped" in d.scalars
    ]
    return steps + others


def _comparable(verdicts):
    return [
        (
            step,
            v
            if not isinstance(v, Finding)
            else (v.step, v.title, json.dumps(v.evidence, sort_keys=True), v.cause),
        )
        for step, v in verdicts
    ]


@pytest.mark.parametrize("rule_type", sorted(RULE_TYPES))
def test_state_survives_json_between_every_step(rule_type):
    steps = _rich_run()
    plain, state = feed(make_rule(rule_type), steps)
    tripped, tripped_state = feed(make_rule(rule_type), steps, round_trip=True)
    assert _comparable(tripped) == _comparable(plain)
    assert json.dumps(tripped_state, sort_keys=True) == json.dumps(state, sort_keys=True)


def test_the_rich_run_exercises_the_rules():
    """So that the round-trip test above compares findings, not just silence."""
    steps = _rich_run()
    firing = {name for name in RULE_TYPES if findings_of(feed(make_rule(name), steps)[0])}
    assert {
        "skip_storm",
        "loss_non_finite",
        "misuse",
        "lr_jump",
        "clip_saturation",
        "underflow",
        "dead_layers",
        "not_learning",
        "rank_disagreement",
        "update_ratio",
    } <= firing


ALL_SCALARS = sorted({key for rule in RULE_TYPES.values() for key in rule.scalar_keys} | {"lr", "loss"})
ALL_VECTORS = sorted({key for rule in RULE_TYPES.values() for key in rule.vector_keys})
ALL_EVENTS = sorted({kind for rule in RULE_TYPES.values() for kind in rule.event_kinds} | {"skip"})


def _odd_steps():
    odd = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308, 5e-324]
    steps = [StepData(0, 0)]
    step = 1
    for value in odd:
        for key in ALL_SCALARS:
            steps.append(StepData(step, 0, scalars={key: value}))
            step += 1
        steps.append(StepData(step, 0, scalars=dict.fromkeys(ALL_SCALARS, value)))
        step += 1
    for row in ([], [math.nan], [0.0], [math.inf, -math.inf, math.nan, 0.0, 1.0, 2.0, 3.0, 4.0], [-1.0, 2.0]):
        for _ in range(3):
            steps.append(
                StepData(step, 0, scalars={"amp/skipped": 0.0}, vectors=dict.fromkeys(ALL_VECTORS, row))
            )
            step += 1
        for key in ALL_VECTORS:
            steps.append(StepData(step, 0, vectors={key: row}))
            step += 1
    for kind in ALL_EVENTS:
        steps.append(StepData(step, 0, events=[(kind, {})]))
        steps.append(
            StepData(
                step + 1,
                0,
                scalars={"amp/scale": math.nan, "amp/skipped": 1.0, "loss": math.nan},
                events=[
                    (
                        kind,
                        {
                            "layers": [],
                            "ids": None,
                            "non_finite_layers": None,
                            "hint": None,
                            "scale_before": "x",
                            "ids_logged": True,
                        },
                    )
                ],
            )
        )
        step += 2
    steps += [
        StepData(step + i, 0, scalars={"amp/scale": s, "amp/skipped": k})
        for i, (s, k) in enumerate(
            [(0.0, 1.0), (0.0, 1.0), (math.nan, 0.0), (math.inf, 0.0), (1.0, math.nan)]
        )
    ]
    steps.append(StepData(step + 10, 3, scalars={"amp/skipped": 1.0}))
    return steps


@pytest.mark.parametrize("rule_type", sorted(RULE_TYPES))
def test_odd_inputs_never_raise(rule_type):
    """NaN/Inf/zero/negative scalars, missing keys, empty vectors, vectors shorter (or longer) than the
    layers, events without data; with state round trips in between."""
    for layers in (LAYERS, (), ("only",)):
        verdicts, _ = feed(make_rule(rule_type), _odd_steps(), layers=layers, round_trip=True)
        for _, verdict in verdicts:
            if isinstance(verdict, Finding):
                json.dumps(verdict.evidence)


@pytest.mark.parametrize(
    ("rule_type", "data"),
    [
        (
            "scaler_calibration",
            StepData(
                5,
                0,
                scalars={"amp/skipped": 1.0, "amp/scale": 8.0},
                events=[("skip", {"non_finite_layers": 3})],
            ),
        ),
        (
            "dead_layers",
            StepData(5, 0, vectors={"grad/norm": [0.0]}, events=[("no_gradient", {"layers": 7})]),
        ),
        (
            "loss_non_finite",
            StepData(
                5, 0, scalars={"loss": math.nan}, events=[("bad_batch", {"ids_logged": True, "ids": 123})]
            ),
        ),
    ],
    ids=["skip-layers-int", "no-gradient-layers-int", "bad-batch-ids-int"],
)
def test_event_data_of_the_wrong_type_does_not_raise(rule_type, data):
    rule = make_rule(rule_type)
    rule.observe(rule.initial_state(), data, list(LAYERS))


def test_rank_disagreement_compares_ranks_at_one_step():
    rule = make_rule("rank_disagreement")
    rank0 = scalar_steps("amp/skipped", [0.0, 1.0, 0.0], rank=0)
    rank1 = scalar_steps("amp/skipped", [0.0, 0.0, 0.0], rank=1)
    verdicts, _ = feed(rule, rank0 + rank1)
    finding = first_finding(verdicts)
    assert (
        finding.step == 1
        and finding.evidence["skipped_ranks"] == [0]
        and finding.evidence["applied_ranks"] == [1]
    )


def test_update_ratio_band_names_the_layers_outside():
    rule = make_rule("update_ratio", {"low": 1e-5, "high": 1e-2})
    steps = [
        StepData(0, 0, vectors={"update/ratio": [1e-3, 5e-2]}),
        StepData(1, 0, vectors={"update/ratio": [1e-3, 1e-3]}),
    ]
    verdicts, _ = feed(rule, steps, layers=("a", "b"))
    assert verdicts[0][1].evidence["layers"] == ["b"] and verdicts[0][1].cause == "update_ratio_high"
    assert verdicts[1][1] is CLEAR


def test_update_ratio_band_ignores_layers_whose_weights_were_zero_and_flags_nan():
    """+inf is a layer whose weights were zero before the step (the agent's update_ratios): undefined,
    not high; NaN (weights or update not finite) is outside the band."""
    rule = make_rule("update_ratio", {"low": 1e-5, "high": 1e-2})
    steps = [
        StepData(0, 0, vectors={"update/ratio": [1e-3, math.inf]}),  # LoRA B at its first step
        StepData(1, 0, vectors={"update/ratio": [math.nan, 1e-3]}),
    ]
    verdicts, _ = feed(rule, steps, layers=("a", "lora_B"))
    assert verdicts[0][1] is CLEAR
    assert verdicts[1][1].evidence["layers"] == ["a"] and verdicts[1][1].cause == "update_ratio_high"
