"""The mixed-precision rules as pure functions of steps: the loss scaler's calibration, skip storms,
scale drops and floors, non-finite gradients, non-finite losses and fp16 misuse.

Step sequences are built by hand to mirror the real mechanisms (rule_steps.Scaler replays a torch
GradScaler as the agent reports it).
"""

import json
import math

import pytest
from rule_steps import Scaler, feed, feed_batches, findings_of, first_finding, scalar_steps

from gradwatch._text import scale_change
from gradwatch.server.alerts.rules import CLEAR, ScalerPhase, StepData, make_rule


def _megatron_start(scaler_kwargs=None, clean=200):
    """init_scale 2^32: 17 overflows in a row halve it to 2^15, then it trains cleanly."""
    scaler = Scaler(init_scale=2.0**32, **(scaler_kwargs or {}))
    return scaler, scaler.run("x" * 17 + "." * clean)


SCALER_RULES = ("scaler_calibration", "scale_drop", "skip_storm", "non_finite", "scale_floor")


# -- ScalerPhase and calibration -------------------------------------------------------------------


def test_scaler_phase_classifies_calibration_then_the_sawtooths_probe_then_real_skips():
    scaler = Scaler(init_scale=2.0**20, growth_interval=20)
    steps = scaler.run("xxx" + "." * 20 + "x" + "." * 5 + "x")
    phase = ScalerPhase.initial()
    kinds = [ScalerPhase.observe(phase, data) for data in steps]
    assert kinds[:13] == ["calibrating"] * 13  # 3 skips, then 10 clean steps end it
    assert phase["ended"] == 12 and phase["start"] == 0 and phase["start_scale"] == 2.0**20
    assert kinds[13:23] == ["applied"] * 10  # the scale grew at step 22 (20 clean in a row)
    assert kinds[23] == "probe"  # the back-off right after a growth: the sawtooth
    assert kinds[-1] == "skip"  # a back-off no growth explains
    assert ScalerPhase.observe(phase, StepData(99, 0, scalars={"loss": 1.0})) is None
    assert json.loads(json.dumps(phase)) == phase


@pytest.mark.parametrize("rule_type", SCALER_RULES)
def test_a_megatron_style_start_is_calibration_not_an_incident(rule_type):
    """init_scale=2**32 overflows 17 times in a row (inf norm, finite loss) before the scale fits."""
    _, steps = _megatron_start()
    verdicts, _ = feed(make_rule(rule_type), steps)
    assert findings_of(verdicts) == []
    assert verdicts[-1][1] is CLEAR


@pytest.mark.parametrize("rule_type", SCALER_RULES)
def test_the_grow_back_off_sawtooth_stays_silent_over_many_intervals(rule_type):
    """Each growth is followed by one overflow that backs the scale off to where it was (x40 intervals)."""
    scaler = Scaler(init_scale=2.0**16, growth_interval=50)
    steps = scaler.run("xx" + "." * 60)
    for _ in range(40):
        steps += scaler.run("x" + "." * 50)  # the growth at the 50th clean step, the probe next
    verdicts, _ = feed(make_rule(rule_type), steps)
    assert findings_of(verdicts) == []


def test_a_layer_that_overflows_every_step_fails_calibration_by_the_time_the_scale_is_below_one():
    scaler = Scaler(init_scale=2.0**16, layers=("attn.out.weight",))
    steps = scaler.run("x" * 40)
    calibration = findings_of(feed(make_rule("scaler_calibration"), steps)[0])
    step, finding = calibration[0]
    assert 15 <= step <= 17  # 2^16 halved 16 times is 2^0; once more is below 1
    assert finding.evidence["values"][0] == 2.0**16 and finding.evidence["values"][1] < 1.0
    assert finding.evidence["skipped"] == step + 1 and finding.evidence["calibration_steps"] == step + 1
    assert finding.evidence["layers"] == ["attn.out.weight"]
    assert "below 1" in finding.evidence["reason"] and "2^16" in finding.title
    floor = findings_of(feed(make_rule("scale_floor"), steps)[0])
    assert 15 <= floor[0][0] <= 17 and "below 1" in floor[0][1].title
    # calibration never ended: the storm rules leave it to scaler_calibration
    for rule_type in ("scale_drop", "skip_storm", "non_finite"):
        assert findings_of(feed(make_rule(rule_type), steps)[0]) == []


def test_skips_at_an_unchanged_scale_are_a_floor():
    """A scaler with a minimum (or a scale it cannot lower) skips again and again at one scale."""
    steps = Scaler(init_scale=4.0).run("xx")  # 2, 1
    for step in range(2, 12):
        steps.append(StepData(step, 0, scalars={"amp/scale": 1.0, "amp/skipped": 1.0, "loss": 1.0}))
    verdicts, _ = feed(make_rule("scaler_calibration"), steps)
    step, finding = findings_of(verdicts)[0]
    assert step == 6  # the 5th skip in a row at 2^0
    assert "floor" in finding.evidence["reason"] and "2^0" in finding.evidence["reason"]


def test_intermittent_overflow_without_a_clean_stretch_fails_calibration():
    scaler = Scaler(init_scale=2.0**20)
    steps = scaler.run("xxx" + "....x" * 12)  # never 10 clean steps in a row
    verdicts, _ = feed(make_rule("scaler_calibration"), steps)
    step, finding = findings_of(verdicts)[0]
    assert step == 3 + 25  # settle_steps after the first applied step (3)
    assert "within 25 steps" in finding.evidence["reason"]


def test_a_calibration_that_ends_resolves_the_calibration_finding():
    scaler = Scaler(init_scale=2.0**20)
    steps = scaler.run("xxx" + "....x" * 6 + "." * 15)
    verdicts, _ = feed(make_rule("scaler_calibration", {"settle_steps": 20}), steps)
    assert findings_of(verdicts)
    assert verdicts[-1][1] is CLEAR


@pytest.mark.parametrize("how", ["event", "lowered", "jump"])
def test_a_restored_or_reset_scale_restarts_calibration(how):
    """A resume loads a scaler state: the scale after it (lower or much higher) is calibration again."""
    scaler = Scaler(init_scale=2.0**16, growth_interval=2000)
    steps = scaler.run("xx" + "." * 300)  # calibrated at 2^14
    if how == "event":
        steps += scaler.restore(2.0**8)
        steps += scaler.run("." * 100)
    elif how == "lowered":  # no event: the scale is lower on an applied step, which the scaler never does
        steps += scaler.restore(2.0**8, event=False)
        steps += scaler.run("." * 100)
    else:  # reset by hand to 2^24: it backs off 10 times before fitting again
        steps += scaler.restore(2.0**24, event=False)
        steps += scaler.run("x" * 10 + "." * 100)
    for rule_type in SCALER_RULES:
        verdicts, _ = feed(make_rule(rule_type), steps)
        assert findings_of(verdicts) == [], rule_type
    phase = ScalerPhase.initial()
    for data in steps:
        ScalerPhase.observe(phase, data)
    assert phase["start"] == 302 and not phase["calibrating"]


def test_a_resumed_run_calibrates_again_after_the_event_even_when_it_skips():
    scaler = Scaler(init_scale=2.0**16)
    steps = scaler.run("x" + "." * 200)
    steps += scaler.restore(2.0**24)
    steps += scaler.run("xxxxxxxx" + "." * 50)  # 2^24 -> 2^16: calibration, not an 256x scale drop
    for rule_type in SCALER_RULES:
        assert findings_of(feed(make_rule(rule_type), steps)[0]) == [], rule_type


# -- after calibration: storms, drops, non-finite gradients ---------------------------------------


def test_skip_storm_after_calibration_counts_skips_no_growth_explains():
    scaler, steps = _megatron_start(clean=100)
    steps += scaler.run("x.x.x..x" + "." * 60)
    verdicts, _ = feed(make_rule("skip_storm"), steps)
    step, finding = findings_of(verdicts)[0]
    assert step == 117 + 7
    assert finding.evidence["count"] == 4 and finding.evidence["steps"] == [117, 119, 121, 124]
    assert finding.evidence["scales"][-1] == 2.0**11
    assert finding.evidence["layers"] == ["hidden.weight"]
    assert "2^11" in finding.title
    assert findings_of(verdicts)[-1][0] == 166  # until step 117 leaves the 50-step window
    assert verdicts[-1][1] is CLEAR


def test_skip_storm_ignore_first_holds_back_judgement():
    scaler, steps = _megatron_start(clean=20)
    steps += scaler.run("xxxx" + "." * 10)
    verdicts, _ = feed(make_rule("skip_storm", {"ignore_first": 100}), steps)
    assert findings_of(verdicts) == []


def test_scale_drop_fires_on_8x_after_calibration_and_clears_when_the_peak_leaves_the_window():
    scaler, steps = _megatron_start(clean=100)  # 2^15 from step 17
    steps += scaler.run("xxx" + "." * 30)  # steps 117-119: 2^14, 2^13, 2^12
    verdicts, _ = feed(make_rule("scale_drop", {"factor": 8, "window": 10}), steps)
    findings = findings_of(verdicts)
    step, finding = findings[0]
    assert step == 119
    assert finding.evidence["values"] == [2.0**15, 2.0**12] and finding.evidence["ratio"] == 8
    assert finding.evidence["steps"] == [116, 119]
    assert finding.evidence["skip_steps"] == [117, 118, 119]
    assert finding.evidence["layers"] == ["hidden.weight"]
    assert finding.title == "loss scale fell 2^15 -> 2^12 (8x) at steps 117-119 (3 skipped)"
    first_clear = next(s for s, v in verdicts if v is CLEAR and s > 119)
    assert first_clear == 126  # step 116 left the 10-step window


def test_scale_drop_and_the_run_pages_skip_row_tell_one_fall_with_one_number():
    """The demo's burst: the scale grew to 2^17 (growth_interval 100), then steps 150-153 overflowed. The
    run page's row said "2^17 -> 2^13" (16x) while the alert said "fell 8x in 3 steps (2^16 at step
    150...)", and its evidence left out step 150 (the first skip after a growth, taken for the sawtooth's
    probe). Both now word the fall with one function: the same text, the four skipped steps."""
    from gradwatch.dashboard.verdict import condense_events

    for clean_before in (49, 0):  # the burst right after a growth (a "probe" first), or 50 steps later
        scaler = Scaler(init_scale=2.0**16, growth_interval=100)
        steps = scaler.run(
            "." * clean_before + "x" + "." * (149 - clean_before) if clean_before else "." * 150
        )
        before = steps[-1].scalars["amp/scale"]
        steps += scaler.run("xxxx" + "." * 20)
        verdicts, _ = feed_batches(make_rule("scale_drop"), steps, [150, 152])
        finding = findings_of(verdicts)[-1][1]
        events = [
            {"step": d.step, "kind": "skip", "rank": 0, "data": {"scale_before": b, "scale_after": a}}
            for d, b, a in zip(
                steps[150:154],
                [before / 2**i for i in range(4)],
                [before / 2 ** (i + 1) for i in range(4)],
                strict=True,
            )
        ]
        row = condense_events(events)[0]["streak"]["text"]
        fall = scale_change(before, before / 16)
        assert fall in row and fall in finding.title, (row, finding.title)
        assert finding.evidence["skip_steps"] == [150, 151, 152, 153] and "(4 skipped)" in finding.title


def test_scale_drop_is_silent_on_a_4x_drop():
    scaler, steps = _megatron_start(clean=100)
    steps += scaler.run("xx" + "." * 30)
    assert findings_of(feed(make_rule("scale_drop"), steps)[0]) == []


def test_scale_drop_does_not_count_the_sawtooths_back_off_as_part_of_a_drop():
    scaler = Scaler(init_scale=2.0**16, growth_interval=40)
    steps = scaler.run("." * 40)  # calibrated at 2^16; it grows to 2^17 at step 39
    steps += scaler.run("x")  # the probe: back to 2^16 (healthy)
    steps += scaler.run("....xx" + "." * 10)  # then a real 4x drop, 2^16 -> 2^14
    verdicts, _ = feed(make_rule("scale_drop", {"factor": 8}), steps)
    assert findings_of(verdicts) == []


def test_non_finite_leaves_a_nan_loss_on_skipped_steps_to_loss_non_finite():
    scaler, steps = _megatron_start(clean=50)
    steps += scaler.run("xxxxx", loss=math.nan, skipped_norm=math.nan)
    steps += scaler.run("." * 10)
    verdicts, _ = feed(make_rule("non_finite"), steps)
    assert findings_of(verdicts) == []


def test_non_finite_fires_on_a_streak_of_overflows_with_a_finite_loss_after_calibration():
    scaler, steps = _megatron_start(clean=50)
    steps += scaler.run("xxxx")
    verdicts, _ = feed(make_rule("non_finite", {"consecutive": 3}), steps)
    step, finding = findings_of(verdicts)[0]
    assert step == 67 + 2
    assert finding.evidence["applied"] is False and finding.evidence["steps"] == [67, 68, 69]
    assert finding.evidence["layers"] == ["hidden.weight"] and finding.cause == ""


def test_non_finite_fires_at_once_when_an_inf_norm_is_applied():
    _, steps = _megatron_start(clean=30)
    steps.append(
        StepData(
            47,
            0,
            scalars={"amp/scale": 2.0**15, "amp/skipped": 0.0, "grad/global_norm": math.inf, "loss": 2.0},
        )
    )
    verdicts, _ = feed(make_rule("non_finite"), steps)
    step, finding = findings_of(verdicts)[0]
    assert step == 47 and finding.evidence["applied"] is True and finding.cause == "non_finite_applied"
    assert "applied" in finding.title


def test_non_finite_in_a_run_without_a_scaler_fires_on_the_first_non_finite_norm():
    """bf16 / fp32: no amp/skipped, every step is applied."""
    norms = [1.0] * 10 + [math.nan, 1.0]
    steps = [StepData(i, 0, scalars={"grad/global_norm": n, "loss": 2.0}) for i, n in enumerate(norms)]
    verdicts, _ = feed(make_rule("non_finite"), steps)
    assert [(s, v.evidence["applied"]) for s, v in findings_of(verdicts)] == [(10, True)]
    assert verdicts[-1] == (11, CLEAR)


# -- loss_non_finite, misuse -------------------------------------------------------------------------


def test_loss_non_finite_names_the_first_step_and_its_batch_and_resolves():
    steps = scalar_steps("loss", [2.0] * 5)
    steps.append(
        StepData(
            5,
            0,
            scalars={"loss": math.nan},
            events=[("bad_batch", {"ids_logged": True, "ids": ["doc-17", "doc-18"]})],
        )
    )
    steps.append(StepData(6, 0, scalars={"loss": math.inf}, events=[("bad_batch", {"ids_logged": False})]))
    steps += scalar_steps("loss", [2.0] * 5, start=7)
    verdicts, _ = feed(make_rule("loss_non_finite", {"clear_after": 5}), steps)
    findings = findings_of(verdicts)
    assert [s for s, _ in findings] == [5, 6]
    first = findings[0][1]
    assert first.evidence["first_step"] == 5 and first.evidence["batch_ids"] == ["doc-17", "doc-18"]
    assert "step 5" in first.title and "doc-17" in first.title
    second = findings[1][1]
    assert second.evidence["steps"] == [5, 6] and second.evidence["batches"] == {"5": ["doc-17", "doc-18"]}
    assert second.evidence["first_step"] == 5
    assert [v for _, v in verdicts[-5:]] == [None, None, None, None, CLEAR]


def test_loss_non_finite_reads_amp_loss_without_a_logged_loss():
    steps = scalar_steps("amp/loss", [1.0, 1.0, math.nan])
    finding = first_finding(feed(make_rule("loss_non_finite"), steps)[0])
    assert (
        finding.step == 2 and finding.evidence["key"] == "amp/loss" and finding.evidence["batch_ids"] is None
    )
    assert "batch" not in finding.title


def test_loss_non_finite_after_resolving_names_the_new_step():
    steps = [
        StepData(5, 0, scalars={"loss": math.nan}, events=[("bad_batch", {"ids_logged": True, "ids": [1]})])
    ]
    steps += scalar_steps("loss", [2.0] * 1000, start=6)
    steps.append(
        StepData(
            2000, 0, scalars={"loss": math.nan}, events=[("bad_batch", {"ids_logged": True, "ids": [99]})]
        )
    )
    verdicts, _ = feed(make_rule("loss_non_finite", {"clear_after": 100}), steps)
    assert CLEAR in [v for _, v in verdicts]
    step, finding = findings_of(verdicts)[-1]
    assert step == 2000
    assert finding.evidence["first_step"] == 2000 and finding.evidence["batch_ids"] == [99]


def test_misuse_fires_once_per_kind_and_never_clears():
    steps = [
        StepData(
            3, 0, events=[("clip_before_unscale", {"hint": "call scaler.unscale_ first", "max_norm": 1.0})]
        ),
        StepData(4, 0, events=[("clip_before_unscale", {"hint": "again"})]),
        StepData(9, 0, events=[("bf16_model_in_fp16", {"hint": 42}), ("skip", {})]),
        StepData(10, 0, events=[("bf16_model_in_fp16", {}), ("clip_before_unscale", {})]),
    ]
    verdicts, _ = feed(make_rule("misuse"), steps)
    assert [(s, type(v).__name__) for s, v in verdicts] == [
        (3, "Finding"),
        (4, "NoneType"),
        (9, "Finding"),
        (10, "NoneType"),
    ]
    first, second = verdicts[0][1], verdicts[2][1]
    assert first.evidence["kinds"] == ["clip_before_unscale"] and first.cause == "clip_before_unscale"
    assert second.evidence["kinds"] == ["clip_before_unscale", "bf16_model_in_fp16"]
    assert second.evidence["steps"] == [3, 9] and second.evidence["hints"] == [
        "call scaler.unscale_ first",
        "",
    ]
    assert second.cause == "clip_before_unscale" and "first at step 3" in second.title
    assert CLEAR not in [v for _, v in verdicts]
