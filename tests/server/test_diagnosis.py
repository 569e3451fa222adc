"""diagnose(): one incident's findings and run context -> the most likely cause and next steps with numbers.

Pure: findings are plain dicts shaped as the engine passes them ({"rule", "title", "step", "severity",
"evidence"}, the evidence as the store keeps it), built from the rule types' own findings where it matters.
"""

import json
import math

import pytest

from gradwatch.server.alerts.diagnosis import RunContext, diagnose, lr_jump_near, scaler_settings
from gradwatch.server.alerts.rules import RULE_TYPES, Finding, StepData, make_rule
from gradwatch.server.storage.codecs import dump_json


def _finding(rule, step, evidence, title="", severity=None):
    """A finding as the engine hands it to diagnose(): evidence through the store's JSON."""
    return {
        "rule": rule,
        "title": title or f"{rule} at step {step}",
        "step": step,
        "severity": severity or RULE_TYPES[rule].severity,
        "evidence": json.loads(dump_json(evidence)),
    }


def _from_rule(rule_type, steps, layers=("embed.weight", "hidden.weight", "head.weight"), params=None):
    """The first finding the rule type itself produces on these steps, shaped as above."""
    rule = make_rule(rule_type, params)
    state = rule.initial_state()
    for data in steps:
        if rule.reads(data):
            verdict = rule.observe(state, data, list(layers))
            if isinstance(verdict, Finding):
                return _finding(rule_type, verdict.step, verdict.evidence, verdict.title)
    raise AssertionError(f"{rule_type} did not fire")


def _nan_loss(step, ids=("doc-3", "doc-9")):
    steps = [StepData(s, 0, scalars={"loss": 2.0}) for s in range(step - 5, step)]
    steps.append(
        StepData(
            step,
            0,
            scalars={"loss": math.nan},
            events=[("bad_batch", {"ids_logged": True, "ids": list(ids)})],
        )
    )
    return _from_rule("loss_non_finite", steps)


def _overflow_every_step(layer="attn.out.weight"):
    steps = []
    scale = 2.0**16
    for step in range(30):
        scale /= 2
        steps.append(
            StepData(
                step,
                0,
                scalars={"amp/scale": scale, "amp/skipped": 1.0, "grad/global_norm": math.inf, "loss": 2.0},
                events=[("skip", {"scale_before": scale * 2, "non_finite_layers": [layer]})],
            )
        )
    return steps


def _steps_text(diagnosis):
    return "\n".join(diagnosis.next_steps)


def _constant_lr(until, lr=1e-3):
    return [(s, lr) for s in range(until + 1)]


# -- setup mistakes first ----------------------------------------------------------------------------


def test_clip_before_unscale_explains_everything_else():
    findings = [
        _finding("misuse", 3, {"kinds": ["clip_before_unscale"], "steps": [3], "hints": ["unscale_ first"]}),
        _from_rule("scaler_calibration", _overflow_every_step()),
        _nan_loss(20),
        _finding("lr_jump", 10, {"values": [1e-3, 0.3], "ratio": 300.0}),
        _finding(
            "clip_saturation",
            40,
            {"median_ratio": 30.0, "max_norm": 1.0, "fraction_clipped": 1.0, "micro_batches": 8},
        ),
    ]
    diagnosis = diagnose(findings, RunContext(fp16_scaler=True, scale=2.0**16, clip_max_norm=1.0))
    assert diagnosis.cause_key == "clip_before_unscale" and diagnosis.severity == "critical"
    assert "scaler.unscale_(optimizer)" in diagnosis.next_steps[0]
    assert "S=2^16" in diagnosis.cause and "max_norm=1" in diagnosis.cause


def test_a_misuse_known_from_the_run_context_alone_is_named():
    findings = [
        _finding("clip_saturation", 40, {"median_ratio": 3e4, "max_norm": 1.0, "fraction_clipped": 1.0})
    ]
    context = RunContext(fp16_scaler=True, scale=2.0**16, misuse={"clip_before_unscale": {"max_norm": 0.5}})
    diagnosis = diagnose(findings, context)
    assert diagnosis.cause_key == "clip_before_unscale" and "max_norm=0.5" in diagnosis.cause


def test_a_bf16_model_in_fp16_says_train_in_bf16_and_names_the_layers():
    findings = [
        _finding("misuse", 0, {"kinds": ["bf16_model_in_fp16"], "steps": [0], "hints": [""]}),
        _from_rule("scaler_calibration", _overflow_every_step("mlp.fc2.weight")),
    ]
    diagnosis = diagnose(findings, RunContext(fp16_scaler=True))
    assert diagnosis.cause_key == "bf16_model_in_fp16"
    assert "bf16" in diagnosis.next_steps[0] and "mlp.fc2.weight" in _steps_text(diagnosis)
    weights = diagnose(findings[1:], RunContext(misuse={"weights_exceed_fp16": {"max_abs_weight": 1.2e5}}))
    assert weights.cause_key == "weights_exceed_fp16" and "1.2e+05" in weights.cause


# -- NaN losses and divergences ----------------------------------------------------------------------


def test_a_nan_loss_without_a_divergence_is_the_data_and_names_the_batch():
    diagnosis = diagnose([_nan_loss(230)], RunContext(fp16_scaler=True, lr=_constant_lr(230)))
    assert diagnosis.cause_key == "loss_non_finite"
    assert "step 230" in diagnosis.cause and "doc-3, doc-9" in diagnosis.cause
    assert "doc-3, doc-9" in diagnosis.next_steps[0] and "(step 230)" in diagnosis.next_steps[0]
    assert "GradScaler skipped" in _steps_text(diagnosis)
    assert diagnosis.title == "the loss is NaN at step 230 on batch doc-3, doc-9"


def test_a_nan_loss_without_batch_ids_asks_for_them_and_an_applied_one_asks_for_a_rewind():
    steps = [StepData(0, 0, scalars={"loss": 1.0}), StepData(1, 0, scalars={"loss": math.inf})]
    loss = _from_rule("loss_non_finite", steps)
    applied = _finding("non_finite", 1, {"applied": True, "steps": [1], "values": [math.nan], "layers": []})
    diagnosis = diagnose([loss, applied], RunContext())
    assert diagnosis.cause_key == "loss_non_finite" and "Infinity" in diagnosis.cause
    assert "run.log_batch" in diagnosis.next_steps[0]
    assert "checkpoint before step 1" in _steps_text(diagnosis)


def test_a_nan_loss_after_an_lr_jump_is_the_lr_jump():
    lr = _constant_lr(199) + [(s, 0.3) for s in range(200, 231)]
    diagnosis = diagnose([_nan_loss(230)], RunContext(fp16_scaler=True, lr=lr))
    assert diagnosis.cause_key == "lr_jump"
    assert "step 200" in diagnosis.cause and "300x" in diagnosis.cause
    steps = _steps_text(diagnosis)
    assert "Lower the learning rate by half (to 0.0005)" in steps
    assert "rewind to the checkpoint before step 200" in steps
    assert "max_norm=0.5" in steps and "a NaN loss" in diagnosis.cause


def test_an_lr_jump_long_before_a_nan_loss_is_not_its_cause():
    lr = _constant_lr(199) + [(s, 0.3) for s in range(200, 301)]
    diagnosis = diagnose([_nan_loss(300)], RunContext(lr=lr))
    assert diagnosis.cause_key == "loss_non_finite"


def test_an_lr_jump_finding_in_the_incident_names_its_step_and_the_lr_to_go_back_to():
    jump = _from_rule(
        "lr_jump", [StepData(s, 0, scalars={"lr": 1e-3 if s < 200 else 0.3}) for s in range(210)]
    )
    spike = _finding("grad_norm_spike", 205, {"onset_step": 203, "ratio": 40.0})
    diagnosis = diagnose([jump, spike], RunContext())
    assert diagnosis.cause_key == "lr_jump" and "step 200" in diagnosis.title
    assert "gradient norm 40x its running median" in diagnosis.cause
    assert "(to 0.0005)" in _steps_text(diagnosis) and "before step 200" in _steps_text(diagnosis)


def test_a_divergence_without_a_trigger_rewinds_to_its_onset_with_half_the_lr():
    spike = _finding("loss_spike", 510, {"onset_step": 505, "ratio": 6.0})
    diagnosis = diagnose([spike], RunContext(lr=[(s, 4e-4) for s in range(0, 520, 10)]))
    assert diagnosis.cause_key == "divergence" and "from step 505" in diagnosis.cause
    assert "(to 0.0002) and rewind to the checkpoint before step 505" in _steps_text(diagnosis)


def test_a_divergence_while_a_warm_up_still_raises_the_lr_names_the_ramp_not_an_unchanged_lr():
    """A linear warm-up over 60 steps to 2e-2 that outruns the model: the loss leaves its range at step 54,
    the lr ~1.8e-2 and still rising. It used to read "learning rate unchanged" (no 2x rise since the
    warning began at 47)."""
    ramp = [(s, 2e-2 * min(1.0, (s + 1) / 60)) for s in range(60)]
    warning = _finding("divergence_warning", 47, {"onset_step": 47, "ratio": 1.2, "precursors": []})
    left = _finding("loss_divergence", 56, {"onset_step": 54, "ratio": 3.1, "steps": [40, 56]})
    diagnosis = diagnose([warning, left], RunContext(lr=ramp))
    assert diagnosis.cause_key == "divergence" and "unchanged" not in diagnosis.title
    assert diagnosis.title.startswith("training diverges from step 47 while a warm-up raises the lr")
    assert "Warm up more slowly or to a lower peak" in _steps_text(diagnosis)
    assert "before step 47" in _steps_text(diagnosis)
    # the same divergence after the warm-up has ended (a constant lr for 60 steps) is "unchanged"
    flat = [(s, 2e-2 * min(1.0, (s + 1) / 60)) for s in range(120)]
    late = [_finding("loss_spike", 115, {"onset_step": 110, "ratio": 6.0})]
    assert "learning rate unchanged" in diagnose(late, RunContext(lr=flat)).title


def test_a_warm_up_before_a_nan_loss_is_not_an_lr_jump():
    lr = [(k, 1e-3 * (1e-3 + (1 - 1e-3) * min(k, 100) / 100)) for k in range(31)]  # x11 at step 1, then <2x
    diagnosis = diagnose([_nan_loss(30)], RunContext(lr=lr))
    assert diagnosis.cause_key == "loss_non_finite"


def test_a_loss_spike_on_a_negative_loss_does_not_break_the_diagnosis():
    losses = [-100.0 + 0.1 * math.sin(i) for i in range(50)] + [-1e-9] * 5
    spike = _from_rule("loss_spike", [StepData(i, 0, scalars={"loss": v}) for i, v in enumerate(losses)])
    assert spike["evidence"]["ratio"] is None  # a ratio to a negative median means nothing
    diagnosis = diagnose([spike], RunContext())
    assert diagnosis.cause_key == "divergence"


# -- the scaler --------------------------------------------------------------------------------------


def test_a_scaler_collapse_gets_scaler_settings_from_the_safe_band():
    findings = [
        _from_rule("scaler_calibration", _overflow_every_step()),
        _from_rule("scale_floor", _overflow_every_step()),
    ]
    diagnosis = diagnose(findings, RunContext(fp16_scaler=True, safe_scale=(2.0**3, 2.0**12)))
    assert diagnosis.cause_key == "scale_collapse"
    assert "attn.out.weight" in diagnosis.cause and "attn.out.weight" in diagnosis.title
    assert diagnosis.next_steps[0].startswith("GradScaler(init_scale=2**7, growth_interval=2000)")
    assert "2^3 and 2^12" in diagnosis.next_steps[0]
    assert "now 2^-1" in diagnosis.cause


@pytest.mark.parametrize("band", [None, (2.0**5, 2.0**4), (5.0, 7.0), (math.nan, 8.0)])
def test_a_scaler_collapse_without_a_band_that_fits_says_bf16(band):
    findings = [_from_rule("scaler_calibration", _overflow_every_step())]
    diagnosis = diagnose(findings, RunContext(fp16_scaler=True, safe_scale=band))
    assert "GradScaler(init_scale" not in _steps_text(diagnosis)
    assert "bf16" in diagnosis.next_steps[0]


def test_an_overflow_storm_names_the_count_and_the_scale():
    storm = _finding(
        "skip_storm",
        500,
        {"count": 6, "scales": [1024.0, 512.0], "layers": ["head.weight"], "steps": [490, 500]},
    )
    diagnosis = diagnose([storm], RunContext(fp16_scaler=True))
    assert diagnosis.cause_key == "overflow"
    assert "6 skipped steps, scale now 2^9" in diagnosis.cause and "head.weight" in diagnosis.cause
    assert "checkpoint before step 500" in _steps_text(diagnosis)


def test_an_applied_non_finite_gradient_says_restart():
    finding = _finding(
        "non_finite", 77, {"applied": True, "steps": [77], "values": [math.inf], "layers": ["head.weight"]}
    )
    diagnosis = diagnose([finding], RunContext())
    assert diagnosis.cause_key == "non_finite_applied"
    assert "checkpoint before step 77" in diagnosis.next_steps[0] and "bf16" in diagnosis.next_steps[1]


def test_underflow_asks_for_a_higher_init_scale():
    steps = [
        StepData(s, 0, vectors={"grad/zero_frac": [0.0, 0.9], "grad/precision_loss_frac": [0.0, 0.95]})
        for s in (10, 20)
    ]
    underflow = _from_rule("underflow", steps, layers=("base.weight", "lora_A"))
    context = RunContext(fp16_scaler=True, scale=2.0**16, safe_scale=(2.0**18, 2.0**24))
    diagnosis = diagnose([underflow], context)
    assert diagnosis.cause_key == "underflow" and "lora_A" in diagnosis.cause and "90%" in diagnosis.cause
    assert "2^16" in diagnosis.cause
    assert diagnosis.next_steps[0].startswith("GradScaler(init_scale=2**23, growth_interval=100)")
    no_band = diagnose([underflow], RunContext(fp16_scaler=True, scale=2.0**16))
    assert "Raise the GradScaler's init_scale" in no_band.next_steps[0]


# -- clipping, dead layers, stalls -------------------------------------------------------------------


def _clipping(ratio, steps=30, **scalars):
    return [
        StepData(i, 0, scalars={"grad/global_norm": ratio, "grad/clip_max_norm": 1.0, **scalars})
        for i in range(steps)
    ]


def test_clip_saturation_with_accumulation_says_divide_the_loss():
    finding = _from_rule("clip_saturation", _clipping(10.8, **{"amp/micro_batches": 8.0}))
    diagnosis = diagnose([finding], RunContext(micro_batches=8.0))
    assert diagnosis.cause_key == "clip_saturation_accumulation"
    assert (
        "(loss / 8).backward()" in diagnosis.next_steps[0]
        and "scaler.scale(loss / 8)" in diagnosis.next_steps[0]
    )
    assert "8 micro-batches" in diagnosis.title


def test_clip_saturation_with_accumulation_at_a_ratio_that_does_not_name_the_summed_loss():
    """Evidence stored before undivided_loss existed, or a ratio too low for the micro-batch count: the
    plain cause, never "the loss is summed" (following that advice would divide the loss twice)."""
    for evidence in ({}, {"undivided_loss": False}):
        finding = _from_rule("clip_saturation", _clipping(6.0, steps=220, **{"amp/micro_batches": 16.0}))
        finding["evidence"].pop("undivided_loss", None)
        finding["evidence"].update(evidence)
        diagnosis = diagnose([finding], RunContext(micro_batches=16.0))
        assert diagnosis.cause_key == "clip_saturation"
        assert "summed" not in diagnosis.title + diagnosis.cause and "Divide" not in diagnosis.next_steps[0]


def test_clip_saturation_without_accumulation_names_the_norm_to_clip_at():
    diagnosis = diagnose([_from_rule("clip_saturation", _clipping(4.0, steps=220))], RunContext())
    assert diagnosis.cause_key == "clip_saturation" and "Raise max_norm to about 4" in diagnosis.next_steps[0]


def test_dead_layers_without_a_gradient_point_at_a_detach():
    steps = [StepData(0, 0, events=[("no_gradient", {"layers": ["head.weight"]})])]
    steps += [StepData(s, 0, vectors={"grad/norm": [0.5, 0.4, 0.0]}) for s in range(4)]
    dead = _from_rule("dead_layers", steps)
    diagnosis = diagnose([dead], RunContext())
    assert diagnosis.cause_key == "dead_layers" and "grad is None" in diagnosis.cause
    assert ".detach()" in diagnosis.next_steps[0] and "head.weight" in diagnosis.next_steps[0]
    zero = diagnose(
        [_finding("dead_layers", 4, {"layers": ["x"], "grad_none": []})], RunContext(fp16_scaler=True)
    )
    assert "exactly zero" in zero.cause and "underflowing in fp16" in zero.cause


def test_not_learning_with_a_zero_lr_is_the_schedule():
    steps = [StepData(s, 0, vectors={"update/rounded_away_frac": [1.0, 1.0]}) for s in (100, 200)]
    stalled = _from_rule("not_learning", steps, layers=("a", "b"))
    diagnosis = diagnose([stalled], RunContext(lr=[(0, 1e-3), (150, 0.0)]))
    assert diagnosis.cause_key == "lr_zero" and "step 200" in diagnosis.cause
    rounded = diagnose([stalled], RunContext(lr=[(0, 1e-5)]))
    assert rounded.cause_key == "rounded_away" and "100% of" in rounded.cause and "1e-05" in rounded.cause


def test_an_unknown_rule_falls_back_to_its_finding_and_the_worst_severity_wins():
    findings = [
        _finding("update_ratio", 9, {"layers": ["a"]}, title="update ratio of a is 0.5", severity="info"),
        _finding("heartbeat", 12, {}, severity="critical"),
    ]
    diagnosis = diagnose(findings, RunContext())
    assert (diagnosis.cause_key, diagnosis.cause, diagnosis.next_steps) == (
        "update_ratio",
        "update ratio of a is 0.5",
        [],
    )
    assert diagnosis.severity == "critical"


# -- scaler_settings, lr_jump_near -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("band", "prefer", "expected"),
    [
        (None, "middle", None),
        ((8.0, 8.0), "middle", None),  # empty
        ((16.0, 8.0), "middle", None),  # inverted
        ((5.0, 7.0), "middle", None),  # no power of two inside
        ((0.0, 8.0), "middle", None),
        ((-4.0, 8.0), "middle", None),
        ((math.nan, 8.0), "middle", None),
        ((2.0, math.inf), "middle", None),
        ((5.0, 9.0), "middle", 3),  # only 2^3 fits
        ((5.0, 9.0), "high", 3),
        ((2.0**3, 2.0**12), "middle", 7),
        ((2.0**3, 2.0**12), "high", 11),
        ((2.0**-3, 2.0**-1), "middle", -2),  # below one: still a valid band
    ],
)
def test_scaler_settings_from_the_band(band, prefer, expected):
    settings = scaler_settings(band, prefer=prefer)
    if expected is None:
        assert settings is None
    else:
        assert settings.startswith(f"GradScaler(init_scale=2**{expected}, growth_interval=")
        low, high = band
        assert low <= 2.0**expected <= high


def test_lr_jump_near_picks_the_largest_jump_in_the_lookback():
    lr = [(s, 1e-4) for s in range(100)] + [(100, 2e-3)] + [(s, 2e-3) for s in range(101, 130)]
    lr += [(130, 0.6)] + [(s, 0.6) for s in range(131, 160)]  # x20 at 100, x300 at 130
    assert lr_jump_near(lr, 150) == (130, 2e-3, 0.6)
    assert lr_jump_near(lr, 149, lookback=30) == (130, 2e-3, 0.6)
    assert lr_jump_near(lr, 125) == (100, 1e-4, 2e-3)
    assert lr_jump_near(lr, 99) is None  # a jump after the step is no trigger
    assert lr_jump_near(lr, 200) is None  # both are more than 50 steps back


def test_lr_jump_near_ignores_small_rises_zero_and_non_finite_lrs():
    assert lr_jump_near([(0, 1e-3), (1, 9e-3)], 1) is None  # x9 < 10
    assert lr_jump_near([(0, 0.0), (1, 1e-3)], 1) is None
    assert lr_jump_near([(0, 1e-3), (1, math.nan), (2, math.inf), (3, 1e-3)], 3) is None
    assert lr_jump_near([], 10) is None
    assert lr_jump_near([(5, 1e-3), (0, 1e-5)], 5, points_before=10) == (5, 1e-5, 1e-3)  # unordered input
    assert lr_jump_near([(5, 1e-3), (0, 1e-5)], 5) is None  # too little lr history: a warm-up's first steps
    assert lr_jump_near([(5, 1e-3), (0, 1e-5)], 5, peak_before=1e-3, points_before=10) is None  # a restart


def test_every_rule_type_and_setup_mistake_has_advice():
    from gradwatch.server.alerts.engine import HINTS
    from gradwatch.server.alerts.rules import MISUSE_EVENTS, RULE_TYPES

    assert [name for name in RULE_TYPES if not HINTS.get(name)] == []
    assert "params_not_in_optimizer" in MISUSE_EVENTS and HINTS.get("params_not_in_optimizer")


def _burst(last_step=15):
    nan = {
        **_finding("loss_non_finite", 10, {"steps": [10, 11, 12], "first_step": 10, "values": ["Infinity"]}),
        "last_step": last_step,
    }
    drop = {
        **_finding("scale_drop", 12, {"steps": [9, 12]}),
        "last_step": 400,
    }  # holds while the scale is low
    return [nan, drop]


def test_a_burst_whose_rules_all_cleared_is_named_transient_with_its_span_and_recovery():
    diagnosis = diagnose(_burst(), RunContext(fp16_scaler=True, recovered_step=113))
    assert diagnosis.cause_key == "transient_burst"
    assert diagnosis.title == (
        "a transient burst at steps 10-15 (non-finite losses; overflowing gradients the GradScaler "
        "skipped); training recovered by step 113"
    )
    assert diagnosis.next_steps[0] == "Nothing to fix if it does not come back."


@pytest.mark.parametrize(
    ("context", "findings", "why"),
    [
        (RunContext(fp16_scaler=True), _burst(), "not recovered yet"),
        (RunContext(fp16_scaler=True, recovered_step=200), _burst(last_step=70), "longer than a burst"),
        (
            RunContext(
                fp16_scaler=True, recovered_step=113, lr=[(s, 1e-4 if s < 10 else 1e-2) for s in range(16)]
            ),
            _burst(),
            "an lr jump explains it",
        ),
        (
            RunContext(recovered_step=113),
            [_finding("non_finite", 10, {"applied": True}), *_burst()],
            "NaN reached the weights",
        ),
    ],
)
def test_what_is_not_a_transient_burst(context, findings, why):
    assert diagnose(findings, context).cause_key != "transient_burst", why


def _warmup_to_nan(peak=1.0):
    """A warm-up from 1e-4 to `peak` over steps 0-8 and a loss that climbs 4.4 -> 22, NaN from step 8."""
    lr = [(s, 1e-4 * (peak / 1e-4) ** (s / 8)) for s in range(9)]
    loss = [(s, 4.4 * 5 ** (s / 7)) for s in range(8)]
    nan = _finding("loss_non_finite", 8, {"steps": [8, 9, 10, 11, 12], "first_step": 8, "count": 5})
    return [nan], RunContext(fp16_scaler=True, lr=lr, loss=loss)


def test_a_warm_up_to_a_peak_far_too_high_is_named_with_its_numbers():
    findings, context = _warmup_to_nan()
    diagnosis = diagnose(findings, context)
    assert diagnosis.cause_key == "lr_ramp"
    assert diagnosis.title == (
        "the learning rate ramped 10,000x to 1 by step 8 and the loss rose 5x: the peak lr is too high"
    ), diagnosis.title
    assert "from 0.0001 at step 0" in diagnosis.cause and "before step 0" in diagnosis.next_steps[0]


def test_a_bad_batch_during_a_short_warm_up_is_not_the_ramps_doing():
    _, context = _warmup_to_nan()
    context.loss = [(s, 4.4 - 0.1 * s) for s in range(8)]  # the loss fell all along: a bad batch at step 8
    one = _finding("loss_non_finite", 8, {"steps": [8], "first_step": 8, "count": 1})
    assert diagnose([one], context).cause_key == "loss_non_finite"


def test_forward_overflow_counts_every_non_finite_loss_not_the_capped_list():
    steps = [*range(100, 101), *range(245, 294)]  # the first and the latest 49 of 194 (rule's evidence)
    finding = _finding("loss_non_finite", 100, {"steps": steps, "first_step": 100, "count": 194})
    diagnosis = diagnose([finding], RunContext(fp16_scaler=True))
    assert diagnosis.cause_key == "fp16_forward_overflow"
    assert "non-finite on 194 of 194 steps since step 100" in diagnosis.cause


def test_layers_stalled_by_a_vanishing_gradient_are_named_by_that_cause_not_by_precision():
    """A 12-layer sigmoid stack in fp32: the first layers' gradients are ~1e-12 of the last layer's and
    their updates round away. The cause is the gradient vanishing through depth (a precision fix would
    not help); layers whose gradient is not small keep the rounded-away title (bf16 weights)."""
    layers = (*(f"stack.{i}.weight" for i in range(4)), "head.weight")
    vanishing = [
        StepData(
            s,
            0,
            vectors={
                "update/rounded_away_frac": [1.0, 1.0, 0.0, 0.0, 0.0],
                "grad/norm": [3e-13, 2e-12, 1e-6, 1e-3, 0.4],
            },
        )
        for s in (100, 200)
    ]
    finding = _from_rule("not_learning", vanishing, layers=layers)
    assert finding["evidence"]["grad_norm_shares"] == [pytest.approx(7.5e-13), pytest.approx(5e-12)]
    assert finding["evidence"]["top_grad_layer"] == "head.weight"
    diagnosis = diagnose([finding], RunContext(lr=[(0, 1e-3)]))
    assert diagnosis.cause_key == "vanishing_gradients"
    assert diagnosis.title.startswith(
        "gradients vanish through depth: stack.0.weight, stack.1.weight get ~5e-12"
    )
    assert "head.weight" in diagnosis.title and "round away" not in diagnosis.title
    assert "residual" in diagnosis.next_steps[0]
    bf16 = [
        StepData(
            s,
            0,
            vectors={
                "update/rounded_away_frac": [0.9, 0.9, 0.0, 0.0, 0.0],
                "grad/norm": [0.2, 0.3, 0.3, 0.2, 0.4],
            },
        )
        for s in (100, 200)
    ]
    rounded = diagnose([_from_rule("not_learning", bf16, layers=layers)], RunContext(lr=[(0, 1e-5)]))
    assert rounded.cause_key == "rounded_away"


def test_a_divergence_warning_is_told_as_ahead_until_something_breaks():
    """The warning names its precursors and what to do before the run breaks; a spike rule's warning
    joining it is more of the same evidence; a critical loss_divergence makes it the divergence."""
    losses = [0.26 + 3.74 * math.exp(-i / 30) for i in range(150)] + [
        0.26 + 4.94 * (i + 1) / 100 for i in range(100)
    ]
    norms = [1.0] * 150 + [1.0 + 20 * (i + 1) / 100 for i in range(100)]
    steps = [
        StepData(i, 0, scalars={"loss": v, "lr": 1e-3, "grad/global_norm": n})
        for i, (v, n) in enumerate(zip(losses, norms, strict=True))
    ]
    warning = _from_rule("divergence_warning", steps)
    ahead = diagnose([warning], RunContext(lr=[(0, 1e-3)]))
    assert ahead.cause_key == "divergence_warning" and ahead.severity == "warning"
    assert (
        ahead.title.startswith("divergence ahead: the gradient norm rose") and "(best step 1" in ahead.title
    )
    assert "Lower the learning rate now" in ahead.next_steps[0] and "before step 1" in ahead.next_steps[1]
    spike = _finding("grad_norm_spike", warning["step"] + 3, {"ratio": 12.0, "onset_step": warning["step"]})
    assert diagnose([warning, spike], RunContext()).cause_key == "divergence_warning"
    broke = _from_rule("loss_divergence", steps)
    assert diagnose([warning, broke], RunContext()).cause_key == "divergence"
