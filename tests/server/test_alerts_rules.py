"""The rule types as pure functions of steps: no database, no server, no torch.

Step sequences are built by hand to mirror the real mechanisms: `Scaler` replays what a torch GradScaler
does and what the agent reports of it (a skip halves the scale, and the scale after update is reported at
the same step as amp/skipped=1; growth_interval clean steps in a row double it).
"""

import json
import math

import pytest

from gradwatch.server.alerts.rules import (
    CLEAR,
    DEFAULT_RULES,
    RULE_TYPES,
    Finding,
    ScalerPhase,
    StepData,
    make_rule,
)
from gradwatch.server.alerts.webhooks import render, sign, signature_headers, validate_url, verify

LAYERS = ("embed.weight", "hidden.weight", "head.weight")


# -- helpers ---------------------------------------------------------------------------------------


def _feed(rule, steps, layers=LAYERS, round_trip=False):
    """(step, verdict) for each step the rule reads, as the engine feeds it; round_trip: the state goes
    through json.dumps/json.loads after every step (as if the server restarted between steps)."""
    state = rule.initial_state()
    verdicts = []
    for data in steps:
        if rule.reads(data):
            verdicts.append((data.step, rule.observe(state, data, list(layers))))
            if round_trip:
                state = json.loads(json.dumps(state))
    return verdicts, state


def _findings(verdicts):
    return [(step, v) for step, v in verdicts if isinstance(v, Finding)]


def _first_finding(verdicts):
    return next(v for _, v in verdicts if isinstance(v, Finding))


def _scalars(key, values, rank=0, start=0):
    return [StepData(start + i, rank, scalars={key: v}) for i, v in enumerate(values)]


class Scaler:
    """A torch GradScaler as the agent reports it, one optimizer step per character of a pattern:
    "." a clean (applied) step, "x" an overflow (skipped: the scale halves). After `growth_interval` clean
    steps in a row the scale doubles (reported at that applied step). Steps continue across calls."""

    def __init__(self, init_scale=2.0**16, growth_interval=2000, loss=2.0, layers=("hidden.weight",)):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.tracker = 0
        self.step = 0
        self.loss = loss
        self.layers = list(layers)

    def run(self, pattern, loss=None, norm=1.0, skipped_norm=math.inf, **scalars):
        steps = []
        for char in pattern:
            overflow = char == "x"
            before = self.scale
            if overflow:
                self.scale /= 2
                self.tracker = 0
            else:
                self.tracker += 1
                if self.tracker >= self.growth_interval:
                    self.scale *= 2
                    self.tracker = 0
            values = {
                "amp/scale": self.scale,
                "amp/skipped": 1.0 if overflow else 0.0,
                "grad/global_norm": skipped_norm if overflow else norm,
                "loss": self.loss if loss is None else loss,
                **scalars,
            }
            events = (
                [("skip", {"scale_before": before, "non_finite_layers": self.layers})] if overflow else []
            )
            steps.append(StepData(self.step, 0, scalars=values, events=events))
            self.step += 1
        return steps

    def restore(self, scale, event=True):
        """load_state_dict: the next step starts from `scale` (a resumed run)."""
        self.scale = scale
        self.tracker = 0
        return [StepData(self.step, 0, events=[("scaler_state_loaded", {"scale": scale})])] if event else []


def _megatron_start(scaler_kwargs=None, clean=200):
    """init_scale 2^32: 17 overflows in a row halve it to 2^15, then it trains cleanly."""
    scaler = Scaler(init_scale=2.0**32, **(scaler_kwargs or {}))
    return scaler, scaler.run("x" * 17 + "." * clean)


SCALER_RULES = ("scaler_calibration", "scale_drop", "skip_storm", "non_finite", "scale_floor")


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
    verdicts, _ = _feed(make_rule(rule_type), steps)
    assert _findings(verdicts) == []
    assert verdicts[-1][1] is CLEAR


@pytest.mark.parametrize("rule_type", SCALER_RULES)
def test_the_grow_back_off_sawtooth_stays_silent_over_many_intervals(rule_type):
    """Each growth is followed by one overflow that backs the scale off to where it was (x40 intervals)."""
    scaler = Scaler(init_scale=2.0**16, growth_interval=50)
    steps = scaler.run("xx" + "." * 60)
    for _ in range(40):
        steps += scaler.run("x" + "." * 50)  # the growth at the 50th clean step, the probe next
    verdicts, _ = _feed(make_rule(rule_type), steps)
    assert _findings(verdicts) == []


def test_a_layer_that_overflows_every_step_fails_calibration_by_the_time_the_scale_is_below_one():
    scaler = Scaler(init_scale=2.0**16, layers=("attn.out.weight",))
    steps = scaler.run("x" * 40)
    calibration = _findings(_feed(make_rule("scaler_calibration"), steps)[0])
    step, finding = calibration[0]
    assert 15 <= step <= 17  # 2^16 halved 16 times is 2^0; once more is below 1
    assert finding.evidence["values"][0] == 2.0**16 and finding.evidence["values"][1] < 1.0
    assert finding.evidence["skipped"] == step + 1 and finding.evidence["calibration_steps"] == step + 1
    assert finding.evidence["layers"] == ["attn.out.weight"]
    assert "below 1" in finding.evidence["reason"] and "2^16" in finding.title
    floor = _findings(_feed(make_rule("scale_floor"), steps)[0])
    assert 15 <= floor[0][0] <= 17 and "below 1" in floor[0][1].title
    # calibration never ended: the storm rules leave it to scaler_calibration
    for rule_type in ("scale_drop", "skip_storm", "non_finite"):
        assert _findings(_feed(make_rule(rule_type), steps)[0]) == []


def test_skips_at_an_unchanged_scale_are_a_floor():
    """A scaler with a minimum (or a scale it cannot lower) skips again and again at one scale."""
    steps = Scaler(init_scale=4.0).run("xx")  # 2, 1
    for step in range(2, 12):
        steps.append(StepData(step, 0, scalars={"amp/scale": 1.0, "amp/skipped": 1.0, "loss": 1.0}))
    verdicts, _ = _feed(make_rule("scaler_calibration"), steps)
    step, finding = _findings(verdicts)[0]
    assert step == 6  # the 5th skip in a row at 2^0
    assert "floor" in finding.evidence["reason"] and "2^0" in finding.evidence["reason"]


def test_intermittent_overflow_without_a_clean_stretch_fails_calibration():
    scaler = Scaler(init_scale=2.0**20)
    steps = scaler.run("xxx" + "....x" * 12)  # never 10 clean steps in a row
    verdicts, _ = _feed(make_rule("scaler_calibration"), steps)
    step, finding = _findings(verdicts)[0]
    assert step == 3 + 25  # settle_steps after the first applied step (3)
    assert "within 25 steps" in finding.evidence["reason"]


def test_a_calibration_that_ends_resolves_the_calibration_finding():
    scaler = Scaler(init_scale=2.0**20)
    steps = scaler.run("xxx" + "....x" * 6 + "." * 15)
    verdicts, _ = _feed(make_rule("scaler_calibration", {"settle_steps": 20}), steps)
    assert _findings(verdicts)
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
        verdicts, _ = _feed(make_rule(rule_type), steps)
        assert _findings(verdicts) == [], rule_type
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
        assert _findings(_feed(make_rule(rule_type), steps)[0]) == [], rule_type


# -- after calibration: storms, drops, non-finite gradients ---------------------------------------


def test_skip_storm_after_calibration_counts_skips_no_growth_explains():
    scaler, steps = _megatron_start(clean=100)
    steps += scaler.run("x.x.x..x" + "." * 60)
    verdicts, _ = _feed(make_rule("skip_storm"), steps)
    step, finding = _findings(verdicts)[0]
    assert step == 117 + 7
    assert finding.evidence["count"] == 4 and finding.evidence["steps"] == [117, 119, 121, 124]
    assert finding.evidence["scales"][-1] == 2.0**11
    assert finding.evidence["layers"] == ["hidden.weight"]
    assert "2^11" in finding.title
    assert _findings(verdicts)[-1][0] == 166  # until step 117 leaves the 50-step window
    assert verdicts[-1][1] is CLEAR


def test_skip_storm_ignore_first_holds_back_judgement():
    scaler, steps = _megatron_start(clean=20)
    steps += scaler.run("xxxx" + "." * 10)
    verdicts, _ = _feed(make_rule("skip_storm", {"ignore_first": 100}), steps)
    assert _findings(verdicts) == []


def test_scale_drop_fires_on_8x_after_calibration_and_clears_when_the_peak_leaves_the_window():
    scaler, steps = _megatron_start(clean=100)  # 2^15 from step 17
    steps += scaler.run("xxx" + "." * 30)  # steps 117-119: 2^14, 2^13, 2^12
    verdicts, _ = _feed(make_rule("scale_drop", {"factor": 8, "window": 10}), steps)
    findings = _findings(verdicts)
    step, finding = findings[0]
    assert step == 119
    assert finding.evidence["values"] == [2.0**15, 2.0**12] and finding.evidence["ratio"] == 8
    assert finding.evidence["steps"] == [116, 119]
    assert finding.evidence["skip_steps"] == [117, 118, 119]
    assert finding.evidence["layers"] == ["hidden.weight"]
    assert "2^15 -> 2^12" in finding.title
    first_clear = next(s for s, v in verdicts if v is CLEAR and s > 119)
    assert first_clear == 126  # step 116 left the 10-step window


def test_scale_drop_is_silent_on_a_4x_drop():
    scaler, steps = _megatron_start(clean=100)
    steps += scaler.run("xx" + "." * 30)
    assert _findings(_feed(make_rule("scale_drop"), steps)[0]) == []


def test_scale_drop_does_not_count_the_sawtooths_back_off_as_part_of_a_drop():
    scaler = Scaler(init_scale=2.0**16, growth_interval=40)
    steps = scaler.run("." * 40)  # calibrated at 2^16; it grows to 2^17 at step 39
    steps += scaler.run("x")  # the probe: back to 2^16 (healthy)
    steps += scaler.run("....xx" + "." * 10)  # then a real 4x drop, 2^16 -> 2^14
    verdicts, _ = _feed(make_rule("scale_drop", {"factor": 8}), steps)
    assert _findings(verdicts) == []


def test_non_finite_leaves_a_nan_loss_on_skipped_steps_to_loss_non_finite():
    scaler, steps = _megatron_start(clean=50)
    steps += scaler.run("xxxxx", loss=math.nan, skipped_norm=math.nan)
    steps += scaler.run("." * 10)
    verdicts, _ = _feed(make_rule("non_finite"), steps)
    assert _findings(verdicts) == []


def test_non_finite_fires_on_a_streak_of_overflows_with_a_finite_loss_after_calibration():
    scaler, steps = _megatron_start(clean=50)
    steps += scaler.run("xxxx")
    verdicts, _ = _feed(make_rule("non_finite", {"consecutive": 3}), steps)
    step, finding = _findings(verdicts)[0]
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
    verdicts, _ = _feed(make_rule("non_finite"), steps)
    step, finding = _findings(verdicts)[0]
    assert step == 47 and finding.evidence["applied"] is True and finding.cause == "non_finite_applied"
    assert "applied" in finding.title


def test_non_finite_in_a_run_without_a_scaler_fires_on_the_first_non_finite_norm():
    """bf16 / fp32: no amp/skipped, every step is applied."""
    norms = [1.0] * 10 + [math.nan, 1.0]
    steps = [StepData(i, 0, scalars={"grad/global_norm": n, "loss": 2.0}) for i, n in enumerate(norms)]
    verdicts, _ = _feed(make_rule("non_finite"), steps)
    assert [(s, v.evidence["applied"]) for s, v in _findings(verdicts)] == [(10, True)]
    assert verdicts[-1] == (11, CLEAR)


# -- loss_non_finite, misuse -------------------------------------------------------------------------


def test_loss_non_finite_names_the_first_step_and_its_batch_and_resolves():
    steps = _scalars("loss", [2.0] * 5)
    steps.append(
        StepData(
            5,
            0,
            scalars={"loss": math.nan},
            events=[("bad_batch", {"ids_logged": True, "ids": ["doc-17", "doc-18"]})],
        )
    )
    steps.append(StepData(6, 0, scalars={"loss": math.inf}, events=[("bad_batch", {"ids_logged": False})]))
    steps += _scalars("loss", [2.0] * 5, start=7)
    verdicts, _ = _feed(make_rule("loss_non_finite", {"clear_after": 5}), steps)
    findings = _findings(verdicts)
    assert [s for s, _ in findings] == [5, 6]
    first = findings[0][1]
    assert first.evidence["first_step"] == 5 and first.evidence["batch_ids"] == ["doc-17", "doc-18"]
    assert "step 5" in first.title and "doc-17" in first.title
    second = findings[1][1]
    assert second.evidence["steps"] == [5, 6] and second.evidence["batches"] == {"5": ["doc-17", "doc-18"]}
    assert second.evidence["first_step"] == 5
    assert [v for _, v in verdicts[-5:]] == [None, None, None, None, CLEAR]


def test_loss_non_finite_reads_amp_loss_without_a_logged_loss():
    steps = _scalars("amp/loss", [1.0, 1.0, math.nan])
    finding = _first_finding(_feed(make_rule("loss_non_finite"), steps)[0])
    assert (
        finding.step == 2 and finding.evidence["key"] == "amp/loss" and finding.evidence["batch_ids"] is None
    )
    assert "batch" not in finding.title


def test_loss_non_finite_after_resolving_names_the_new_step():
    steps = [
        StepData(5, 0, scalars={"loss": math.nan}, events=[("bad_batch", {"ids_logged": True, "ids": [1]})])
    ]
    steps += _scalars("loss", [2.0] * 1000, start=6)
    steps.append(
        StepData(
            2000, 0, scalars={"loss": math.nan}, events=[("bad_batch", {"ids_logged": True, "ids": [99]})]
        )
    )
    verdicts, _ = _feed(make_rule("loss_non_finite", {"clear_after": 100}), steps)
    assert CLEAR in [v for _, v in verdicts]
    step, finding = _findings(verdicts)[-1]
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
    verdicts, _ = _feed(make_rule("misuse"), steps)
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


# -- divergence: gradient norm, loss, lr -------------------------------------------------------------


def _noisy(n, level=1.0, amplitude=0.2, start=0):
    return [level * (1.0 + amplitude * math.sin(start + i)) for i in range(n)]


def test_one_odd_gradient_norm_is_not_a_finding():
    rule = make_rule("grad_norm_spike", {"window": 30, "warmup": 10})
    norms = _noisy(30) + [500.0] + _noisy(10, start=31)
    verdicts, _ = _feed(rule, _scalars("grad/global_norm", norms))
    assert _findings(verdicts) == []
    assert verdicts[-1][1] is CLEAR  # once the odd step left the last 5


def test_a_sustained_gradient_norm_rise_is_a_finding_with_its_onset():
    norms = _noisy(60) + [100.0 * x for x in _noisy(10)]
    verdicts, _ = _feed(make_rule("grad_norm_spike"), _scalars("grad/global_norm", norms))
    step, finding = _findings(verdicts)[0]
    assert step == 62 and finding.evidence["onset_step"] == 60
    assert finding.evidence["steps"] == [60, 61, 62] and finding.evidence["ratio"] > 50
    assert 0.8 < finding.evidence["baseline_median"] < 1.2


def test_a_gradual_exponential_gradient_norm_growth_fires_within_about_35_steps():
    norms = _noisy(100) + [10 ** (3 * t / 100) for t in range(101)]  # x1000 in 100 steps from step 100
    verdicts, _ = _feed(make_rule("grad_norm_spike"), _scalars("grad/global_norm", norms))
    step, finding = _findings(verdicts)[0]
    assert 100 < step <= 140
    assert 100 < finding.evidence["onset_step"] <= step


def test_gradient_norm_spike_ignores_skipped_steps_and_non_finite_norms():
    steps = _scalars("grad/global_norm", _noisy(40))
    for step in range(40, 50):
        steps.append(StepData(step, 0, scalars={"grad/global_norm": 1e6, "amp/skipped": 1.0}))
    steps += _scalars("grad/global_norm", [math.inf, math.nan, 0.0, -1.0], start=50)
    verdicts, _ = _feed(make_rule("grad_norm_spike"), steps)
    assert _findings(verdicts) == []


def _cosine(step, period, high=1e-3, low=1e-6):
    return low + (high - low) * 0.5 * (1 + math.cos(math.pi * (step % period) / period))


def test_a_falling_warm_up_loss_is_not_a_spike():
    losses = [10.0 * math.exp(-i / 40) + 1.0 + 0.05 * math.sin(i) for i in range(300)]
    verdicts, _ = _feed(make_rule("loss_spike"), _scalars("loss", losses))
    assert _findings(verdicts) == []


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
    verdicts, _ = _feed(make_rule("loss_spike"), steps)
    assert _findings(verdicts) == []
    assert _findings(_feed(make_rule("lr_jump"), steps)[0]) == []


def test_a_diverging_loss_is_a_spike():
    losses = [1.0 + 0.02 * math.sin(i) for i in range(100)] + [5.0 + 0.1 * math.sin(i) for i in range(20)]
    verdicts, _ = _feed(make_rule("loss_spike"), _scalars("loss", losses))
    step, finding = _findings(verdicts)[0]
    assert step == 102 and finding.evidence["onset_step"] == 100 and finding.evidence["ratio"] > 4
    assert finding.evidence["key"] == "loss"


def test_negative_losses_do_not_crash_and_a_steady_one_is_silent():
    losses = [-100.0 + math.sin(i) for i in range(200)]
    verdicts, _ = _feed(make_rule("loss_spike"), _scalars("loss", losses))
    assert _findings(verdicts) == []
    around_zero = [0.01 * math.sin(i) for i in range(100)] + [0.0, -0.0, -1e-9, 1e-9]
    assert _findings(_feed(make_rule("loss_spike"), _scalars("loss", around_zero))[0]) == []
    rising = [-100.0 + 0.1 * math.sin(i) for i in range(50)] + [50.0] * 5
    verdicts, _ = _feed(make_rule("loss_spike"), _scalars("amp/loss", rising))
    step, finding = _findings(verdicts)[0]  # from -100 to +50: diverging, whatever the sign
    assert step == 52 and finding.evidence["onset_step"] == 50


def test_a_linear_warm_up_is_not_an_lr_jump():
    """LinearLR(start_factor=1e-4, total_iters=5): the first steps rise x2000, x2, x1.5..."""
    lrs = [1e-3 * (1e-4 + (1 - 1e-4) * min(k, 5) / 5) for k in range(300)]
    verdicts, _ = _feed(make_rule("lr_jump"), _scalars("lr", lrs))
    assert _findings(verdicts) == []
    exponential = [1e-3 * 100.0 ** (min(k, 3) - 3) for k in range(50)]  # x100 a step for 3 steps
    assert _findings(_feed(make_rule("lr_jump"), _scalars("lr", exponential))[0]) == []


def test_a_cosine_warm_restart_is_not_an_lr_jump():
    lrs = [_cosine(step, 200) for step in range(1000)]  # eta_min 1e-6 back to 1e-3 every 200 steps
    assert _findings(_feed(make_rule("lr_jump"), _scalars("lr", lrs))[0]) == []


def test_an_lr_jump_far_above_the_peak_fires_at_that_step_and_resolves_when_it_returns():
    lrs = [1e-3] * 200 + [0.3] * 20 + [1e-3] * 5
    verdicts, _ = _feed(make_rule("lr_jump"), _scalars("lr", lrs))
    findings = _findings(verdicts)
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
    verdicts, _ = _feed(make_rule("clip_saturation"), _clip_steps(ratios))
    assert _findings(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_clipping_every_step_at_4x_max_norm_fires():
    verdicts, _ = _feed(make_rule("clip_saturation"), _clip_steps([4.0] * 250, max_norm=0.5))
    step, finding = _findings(verdicts)[0]
    assert step == 199  # without accumulation: 200 steps (early training often clips for a while)
    assert finding.evidence["median_ratio"] == 4.0 and finding.evidence["fraction_clipped"] == 1.0
    assert finding.evidence["max_norm"] == 0.5 and finding.cause == ""
    assert _findings(_feed(make_rule("clip_saturation"), _clip_steps([2.5] * 250))[0]) == []  # below 3x


def test_clipping_with_accumulated_micro_batches_fires_at_a_lower_ratio():
    accumulating = _clip_steps([1.5] * 40, **{"amp/micro_batches": 8.0})
    step, finding = _findings(_feed(make_rule("clip_saturation"), accumulating)[0])[0]
    assert step == 19
    assert finding.evidence["micro_batches"] == 8.0 and finding.cause == "clip_saturation_accumulation"
    assert _findings(_feed(make_rule("clip_saturation"), _clip_steps([1.5] * 40))[0]) == []


def test_clipping_skipped_steps_are_not_counted():
    steps = _clip_steps([4.0] * 40, **{"amp/skipped": 1.0})
    assert _feed(make_rule("clip_saturation"), steps)[0] == [(s.step, None) for s in steps]


# -- per-layer rules: underflow, dead layers, not learning ------------------------------------------


def test_underflow_fires_when_zeros_and_subnormal_survivors_persist():
    steps = [
        StepData(
            s, 0, vectors={"grad/zero_frac": [0.01, 0.9, 0.0], "grad/precision_loss_frac": [0.0, 0.95, 0.0]}
        )
        for s in (10, 20, 30)
    ]
    verdicts, _ = _feed(make_rule("underflow"), steps)
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
    verdicts, _ = _feed(make_rule("underflow"), steps)
    assert _findings(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_a_lora_a_with_an_all_zero_gradient_at_step_zero_is_not_underflow():
    steps = [
        StepData(0, 0, vectors={"grad/zero_frac": [1.0, 0.0], "grad/precision_loss_frac": [math.nan, 0.0]}),
        StepData(1, 0, vectors={"grad/zero_frac": [1.0, 0.0], "grad/precision_loss_frac": [math.nan, 0.0]}),
        StepData(2, 0, vectors={"grad/zero_frac": [0.0, 0.0], "grad/precision_loss_frac": [0.0, 0.0]}),
    ]
    assert _findings(_feed(make_rule("underflow"), steps, layers=("lora_A", "lora_B"))[0]) == []


def test_underflow_by_the_scaled_threshold():
    steps = [StepData(s, 0, vectors={"grad/underflow_frac": [0.0, 0.4]}) for s in (0, 1)]
    finding = _first_finding(_feed(make_rule("underflow"), steps)[0])
    assert finding.evidence["key"] == "grad/underflow_frac" and finding.evidence["layers"] == [
        "hidden.weight"
    ]


def _norms(step, row, skipped=None):
    scalars = {} if skipped is None else {"amp/skipped": skipped}
    return StepData(step, 0, scalars=scalars, vectors={"grad/norm": row})


def test_a_layer_without_gradient_after_an_applied_step_is_dead():
    steps = [StepData(0, 0, events=[("no_gradient", {"layers": ["head.weight"]})])]
    steps += [_norms(s, [0.5, 0.4, 0.0]) for s in range(6)]
    verdicts, _ = _feed(make_rule("dead_layers"), steps)
    findings = _findings(verdicts)
    step, finding = findings[0]
    assert step == 2  # observations at steps 1 and 2 (step 0 had no applied step before it)
    assert finding.evidence["layers"] == ["head.weight"] and finding.evidence["grad_none"] == ["head.weight"]
    assert finding.cause == "dead_layers_none" and finding.evidence["count"] == 1


def test_a_zero_gradient_without_the_event_is_dead_layers_zero():
    steps = [_norms(s, [0.0, 0.4, 0.3], skipped=0.0) for s in range(5)]
    finding = _first_finding(_feed(make_rule("dead_layers"), steps)[0])
    assert finding.cause == "dead_layers_zero" and finding.evidence["grad_none"] == []


def test_a_lora_a_with_zero_gradient_at_step_zero_only_is_not_dead():
    steps = [_norms(0, [0.0, 0.3])] + [_norms(s, [0.01, 0.3]) for s in range(1, 20)]
    verdicts, _ = _feed(make_rule("dead_layers"), steps, layers=("lora_A", "lora_B"))
    assert _findings(verdicts) == []


def test_a_lora_a_stays_silent_while_the_scaler_calibrates():
    """17 skipped steps: B is still 0 and so is A's gradient, until the first applied step has run."""
    steps = [_norms(s, [0.0, 0.3], skipped=1.0) for s in range(17)]
    steps.append(_norms(17, [0.0, 0.3], skipped=0.0))  # the first applied step: B=0 still
    steps += [_norms(s, [0.02, 0.3], skipped=0.0) for s in range(18, 40)]
    verdicts, _ = _feed(make_rule("dead_layers"), steps, layers=("lora_A", "lora_B"))
    assert _findings(verdicts) == []
    stuck = [_norms(s, [0.0, 0.3], skipped=1.0 if s < 17 else 0.0) for s in range(40)]
    step, _ = _findings(_feed(make_rule("dead_layers"), stuck, layers=("lora_A", "lora_B"))[0])[0]
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
    verdicts, _ = _feed(make_rule("not_learning"), steps, layers=("a", "b"))
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
    verdicts, _ = _feed(make_rule("not_learning"), steps, layers=("a", "b"))
    assert _findings(verdicts) == [] and verdicts[-1][1] is CLEAR


def test_an_update_ratio_of_zero_without_the_rounded_signal_is_not_learning():
    steps = [_updates(s, ratios=[0.0, 1e-3]) for s in (1, 2)]
    finding = _first_finding(_feed(make_rule("not_learning"), steps, layers=("a", "b"))[0])
    assert finding.evidence["key"] == "update/ratio" and finding.evidence["layers"] == ["a"]


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
    plain, state = _feed(make_rule(rule_type), steps)
    tripped, tripped_state = _feed(make_rule(rule_type), steps, round_trip=True)
    assert _comparable(tripped) == _comparable(plain)
    assert json.dumps(tripped_state, sort_keys=True) == json.dumps(state, sort_keys=True)


def test_the_rich_run_exercises_the_rules():
    """So that the round-trip test above compares findings, not just silence."""
    steps = _rich_run()
    firing = {name for name in RULE_TYPES if _findings(_feed(make_rule(name), steps)[0])}
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
    """NaN/Inf/zero/negative scalars, missing keys, empty vectors, vectors shorter (or longer) than the layers,
    events without data; with state round trips in between."""
    for layers in (LAYERS, (), ("only",)):
        verdicts, _ = _feed(make_rule(rule_type), _odd_steps(), layers=layers, round_trip=True)
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
    rank0 = _scalars("amp/skipped", [0.0, 1.0, 0.0], rank=0)
    rank1 = _scalars("amp/skipped", [0.0, 0.0, 0.0], rank=1)
    verdicts, _ = _feed(rule, rank0 + rank1)
    finding = _first_finding(verdicts)
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
    verdicts, _ = _feed(rule, steps, layers=("a", "b"))
    assert verdicts[0][1].evidence["layers"] == ["b"] and verdicts[0][1].cause == "update_ratio_high"
    assert verdicts[1][1] is CLEAR


# -- webhooks ----------------------------------------------------------------------------------------


def _incident(**overrides):
    incident = {
        "id": 7,
        "project": "llm",
        "run_id": "r1",
        "run_name": "lora-7b",
        "status": "open",
        "severity": "critical",
        "family": "precision",
        "cause_key": "scale_collapse",
        "title": "the loss scale never settles: gradients overflow at any scale in attn.out.weight",
        "cause": "Gradients overflow fp16 on (nearly) every step in attn.out.weight: the GradScaler keeps halving.",
        "next_steps": [
            "GradScaler(init_scale=2**7, growth_interval=2000): the gradients fit fp16 for loss scales between 2^3 and 2^12.",
            "Keep attn.out.weight in fp32, or train in bf16.",
        ],
        "rules": ["scaler_calibration", "scale_floor"],
        "findings": [
            {
                "rule": "scaler_calibration",
                "title": "the loss scale never settles: 17 of 17 steps skipped",
                "step": 16,
                "severity": "critical",
                "evidence": {"values": [65536.0, 0.5], "ratio": 0.1 + 0.2, "layers": ["attn.out.weight"]},
            },
            {
                "rule": "scale_floor",
                "title": "loss scale 2^-1 is below the floor 1",
                "step": 16,
                "severity": "critical",
                "evidence": {"values": [0.5], "layers": ["attn.out.weight", "mlp.fc1.weight"], "floor": 1.0},
            },
        ],
        "first_step": 16,
        "last_step": 20,
        "resolved_step": None,
        "link": "http://gw.example/dashboard/runs/r1?step=16",
        "created_at": "2024-01-01T00:00:00+00:00",
        "updated_at": None,
        "resolved_at": None,
        "notified_at": None,
    }
    incident.update(overrides)
    return incident


def _strict_loads(text):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_payload_carries_the_event_headline_and_the_incident_document():
    incident = _incident()
    body = _strict_loads(render("json", "incident.firing", incident))
    assert body["event"] == "incident.firing" and body["incident"] == incident
    assert body["text"] == f"[CRITICAL] llm/lora-7b: {incident['title']} (steps 16-20)"


def test_slack_payload_has_the_cause_layers_evidence_next_steps_and_a_button():
    incident = _incident()
    body = _strict_loads(render("slack", "incident.firing", incident))
    assert body["text"].startswith("[CRITICAL] llm/lora-7b:") and "(steps 16-20)" in body["text"]
    texts = json.dumps(body["blocks"])
    assert incident["cause"] in texts and "GradScaler(init_scale=2**7" in texts
    assert "`attn.out.weight`" in texts and "`mlp.fc1.weight`" in texts
    assert "scaler_calibration (step 16)" in texts and "*Rules*" in texts
    assert body["blocks"][-1]["elements"][0]["url"] == incident["link"]


def test_discord_payload_has_the_cause_fields_and_the_link():
    incident = _incident()
    body = _strict_loads(render("discord", "incident.firing", incident))
    embed = body["embeds"][0]
    assert body["content"].startswith("[CRITICAL]") and embed["url"] == incident["link"]
    assert incident["cause"] in embed["description"] and embed["title"] == incident["title"]
    fields = {field["name"]: field["value"] for field in embed["fields"]}
    assert fields["Rules"] == "scaler_calibration, scale_floor" and fields["Where"] == "steps 16-20"
    assert "attn.out.weight" in fields["Layers"] and "GradScaler(init_scale=2**7" in fields["Next steps"]
    assert embed["color"] == 0xD63031


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_a_resolved_incident_says_resolved(fmt):
    incident = _incident(status="resolved", resolved_step=140)
    text = render(fmt, "incident.resolved", incident)
    body = _strict_loads(text)
    headline = {"json": body.get("text"), "slack": body.get("text"), "discord": body.get("content")}[fmt]
    assert headline.startswith("[RESOLVED] llm/lora-7b") and "resolved at step 140" in headline
    if fmt == "discord":
        assert body["embeds"][0]["color"] == 0x27AE60


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_the_test_event_renders_the_sample(fmt):
    sample = _incident(
        id=None,
        run_id=None,
        run_name="test",
        severity="info",
        family="test",
        cause_key="test",
        title="gradwatch test notification",
        next_steps=[],
        rules=[],
        findings=[],
        first_step=None,
        last_step=None,
    )
    body = _strict_loads(render(fmt, "test", sample))
    assert "this webhook works" in json.dumps(body)


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_payloads_are_standard_json_with_evidence_as_the_store_keeps_it(fmt):
    """Evidence reaches render() through the store's JSON (non-finite floats as strings): still standard JSON."""
    from gradwatch.server.storage.codecs import dump_json

    incident = _incident()
    incident["findings"][0]["evidence"].update({"values": [math.inf, math.nan, 1e-300], "ratio": -math.inf})
    stored = json.loads(dump_json(incident))
    body = _strict_loads(render(fmt, "incident.firing", stored))
    assert body


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown webhook format 'teams'"):
        render("teams", "incident.firing", _incident())


def test_signature_round_trip_and_url_validation():
    body = b'{"a":1}'
    headers = signature_headers("s3cret", 1_700_000_000, body)
    assert headers["X-Gradwatch-Signature"] == sign("s3cret", "1700000000", body)
    assert verify("s3cret", headers, body, now=1_700_000_010)
    assert not verify("s3cret", headers, body + b" ", now=1_700_000_010)
    assert not verify("s3cret", headers, body, now=1_700_009_999)  # too old
    with pytest.raises(ValueError, match="http:// or https://"):
        validate_url("ftp://example.com/x")
    with pytest.raises(ValueError, match="not allowed"):
        validate_url("https://evil.example/x", ("hooks.slack.com",))


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
    verdicts, _ = _feed(make_rule("dead_layers"), steps)
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
    verdicts, _ = _feed(make_rule("underflow"), under)
    assert not any(isinstance(v, Finding) for _, v in verdicts)


def test_slack_and_discord_payloads_cannot_ping_or_disguise_links():
    import json

    incident = {
        "id": 1,
        "project": "p",
        "run_id": "r",
        "run_name": "<!channel> @everyone <https://evil.example|Click here>",
        "status": "open",
        "severity": "critical",
        "title": "t",
        "cause": "c <@U123>",
        "next_steps": [],
        "rules": [],
        "findings": [],
        "first_step": 3,
        "last_step": 3,
        "resolved_step": None,
        "link": "http://x/dashboard/runs/r",
    }
    slack = json.loads(render("slack", "incident.firing", incident))
    text = json.dumps(slack)
    assert "<!channel>" not in text and "<https://evil" not in text and "<@U123>" not in text
    assert "&lt;!channel&gt;" in slack["text"]
    discord = json.loads(render("discord", "incident.firing", incident))
    assert discord["allowed_mentions"] == {"parse": []}
