"""The rule types as pure functions of steps: no database, no server."""

import math

import pytest
from gradwatch.server.alerts.rules import CLEAR, DEFAULT_RULES, RULE_TYPES, Finding, StepData, make_rule
from gradwatch.server.alerts.webhooks import render, sign, signature_headers, validate_url, verify


def _feed(rule, steps, layers=("a", "b")):
    state = rule.initial_state()
    verdicts = []
    for data in steps:
        if rule.reads(data):
            verdicts.append((data.step, rule.observe(state, data, list(layers))))
    return verdicts, state


def _scalars(key, values, rank=0, start=0):
    return [StepData(start + i, rank, scalars={key: v}) for i, v in enumerate(values)]


def _first_finding(verdicts):
    return next(v for _, v in verdicts if isinstance(v, Finding))


def test_every_default_is_a_known_type_and_defaults_validate():
    assert set(DEFAULT_RULES) <= set(RULE_TYPES)
    assert {"scale_drop", "skip_storm", "non_finite"} <= set(DEFAULT_RULES)
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
    ],
)
def test_bad_parameters_are_refused_with_what_is_wrong(rule_type, params, message):
    with pytest.raises((ValueError, TypeError)) as info:
        make_rule(rule_type, params)
    assert message in str(info.value)


def test_scale_drop_fires_at_the_step_the_ratio_is_reached_and_clears_when_it_leaves_the_window():
    rule = make_rule("scale_drop", {"factor": 8, "window": 5})
    scales = [1024.0] * 4 + [512.0, 256.0, 128.0] + [128.0] * 6
    verdicts, _ = _feed(rule, _scalars("amp/scale", scales))
    finding = _first_finding(verdicts)
    assert finding.step == 6
    assert finding.evidence["steps"] == [3, 6] and finding.evidence["values"] == [1024.0, 128.0]
    first_clear = next(step for step, v in verdicts if v is CLEAR and step > 6)
    assert first_clear == 8  # step 3 left the 5-step window


def test_skip_storm_ignores_calibration_and_names_layers():
    rule = make_rule("skip_storm", {"count": 3, "window": 10, "ignore_first": 5})
    steps = []
    for step in range(20):
        skipped = step in (1, 2, 3, 8, 10, 12)
        data = StepData(step, 0, scalars={"amp/skipped": float(skipped)})
        if skipped:
            data.events.append(("skip", {"non_finite_layers": ["hidden.weight"]}))
        steps.append(data)
    verdicts, _ = _feed(rule, steps)
    finding = _first_finding(verdicts)
    assert finding.step == 12 and finding.evidence["steps"] == [8, 10, 12]
    assert finding.evidence["layers"] == ["hidden.weight"]


def test_non_finite_waits_for_a_streak_on_skipped_steps_but_not_on_applied_ones():
    rule = make_rule("non_finite", {"consecutive": 3})
    skipped = [StepData(s, 0, scalars={"loss": math.nan, "amp/skipped": 1.0}) for s in (4, 5, 6)]
    verdicts, _ = _feed(rule, [StepData(3, 0, scalars={"loss": 1.0, "amp/skipped": 0.0}), *skipped])
    assert [v for _, v in verdicts][1:3] == [None, None]
    assert _first_finding(verdicts).step == 6
    applied = [StepData(9, 0, scalars={"grad/global_norm": math.inf, "amp/skipped": 0.0})]
    assert _first_finding(_feed(rule, applied)[0]).evidence["applied"] is True


def test_grad_norm_spike_against_a_robust_baseline():
    rule = make_rule("grad_norm_spike", {"window": 30, "warmup": 10})
    norms = [1.0 + 0.2 * math.sin(i) for i in range(30)] + [500.0, 1.1]
    verdicts, _ = _feed(rule, _scalars("grad/global_norm", norms))
    findings = [(s, v) for s, v in verdicts if isinstance(v, Finding)]
    assert [s for s, _ in findings] == [30]
    assert findings[0][1].evidence["ratio"] > 100
    assert verdicts[-1] == (31, CLEAR)


def test_rank_disagreement_compares_ranks_at_one_step():
    rule = make_rule("rank_disagreement")
    rank0 = _scalars("amp/skipped", [0.0, 1.0, 0.0], rank=0)
    rank1 = _scalars("amp/skipped", [0.0, 0.0, 0.0], rank=1)
    verdicts, _ = _feed(rule, rank0 + rank1)
    finding = _first_finding(verdicts)
    assert finding.step == 1 and finding.evidence["skipped_ranks"] == [0] and finding.evidence["applied_ranks"] == [1]


def test_update_ratio_band_names_the_layers_outside():
    rule = make_rule("update_ratio", {"low": 1e-5, "high": 1e-2})
    steps = [StepData(0, 0, vectors={"update/ratio": [1e-3, 5e-2]}), StepData(1, 0, vectors={"update/ratio": [1e-3, 1e-3]})]
    verdicts, _ = _feed(rule, steps)
    assert verdicts[0][1].evidence["layers"] == ["b"] and verdicts[0][1].cause == "update_ratio_high"
    assert verdicts[1][1] is CLEAR


def test_state_survives_json():
    import json

    rule = make_rule("scale_drop", {"factor": 4, "window": 10})
    state = rule.initial_state()
    for data in _scalars("amp/scale", [64.0, 32.0]):
        rule.observe(state, data, [])
    state = json.loads(json.dumps(state))
    assert isinstance(rule.observe(state, StepData(2, 0, scalars={"amp/scale": 16.0}), []), Finding)


def test_payload_formats():
    alert = {
        "id": 1, "project": "p", "run_id": "r", "run_name": "run", "type": "scale_drop", "severity": "critical",
        "status": "firing", "step": 12, "resolved_step": None, "title": "loss scale fell 8x", "hint": "lower the LR",
        "evidence": {"layers": ["hidden.weight"]}, "link": "http://x/dashboard/runs/r?step=12",
    }
    generic = __import__("json").loads(render("json", "alert.firing", alert))
    assert generic["event"] == "alert.firing" and generic["alert"]["step"] == 12
    slack = __import__("json").loads(render("slack", "alert.firing", alert))
    assert "loss scale fell 8x" in slack["text"] and slack["blocks"][-1]["elements"][0]["url"] == alert["link"]
    discord = __import__("json").loads(render("discord", "alert.resolved", alert))
    assert discord["embeds"][0]["url"] == alert["link"] and "RESOLVED" in discord["content"]


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
