"""Every number in a finding's title is exact: counts are counted in the stored series (not the length of
a capped evidence list), ratios and step ranges are the series' own, and the same steps give the same
text however the agent cut them into batches (issue 29).

Rule-level tests feed the steps at every batch boundary with the state through JSON in between, as the
engine stores it; the end-to-end test posts the same steps to a real server cut two ways, one of them as
the agent cuts them (a step's loss ending one batch, the rest of that step beginning the next).
"""

import json
import math

import httpx
import pytest
from rule_steps import LAYERS, Scaler, batchings, feed_batches, findings_of

from gradwatch._text import scale_change
from gradwatch.server.alerts.diagnosis import RunContext, diagnose
from gradwatch.server.alerts.rules import Finding, StepData, make_rule


def _outcome(verdicts):
    """What a batching must not change: every verdict, with the finding's title and evidence."""
    return [
        (step, (v.title, json.dumps(v.evidence, sort_keys=True)) if isinstance(v, Finding) else repr(v))
        for step, v in verdicts
    ]


def _findings_however_batched(rule_type, steps, params=None):
    """The findings of the rule on the steps, checked to be the same at every batching."""
    outcomes = {}
    for cuts in batchings(len(steps)):
        verdicts, _ = feed_batches(make_rule(rule_type, params), steps, cuts)
        outcomes.setdefault(json.dumps(_outcome(verdicts)), cuts)
    assert len(outcomes) == 1, f"{rule_type}: the text depends on the batching: {list(outcomes.values())}"
    verdicts, _ = feed_batches(make_rule(rule_type, params), steps, [])
    return findings_of(verdicts)


def _series(steps, key):
    return {d.step: d.scalars[key] for d in steps if key in d.scalars}


def _zero_grad_collapse():
    """A loop that never clears .grad: after a clean start every step overflows, the scale halves each
    time and falls below 1 (the issue's "0 of 300 steps skipped" run, shortened)."""
    scaler = Scaler(init_scale=2.0**16)
    return scaler.run("." * 20 + "x" * 40)


def test_a_calibration_title_counts_every_skip_since_its_start():
    steps = _zero_grad_collapse()
    [(step, finding), *_] = _findings_however_batched("scaler_calibration", steps)
    skipped = _series(steps, "amp/skipped")
    count = sum(1 for s, v in skipped.items() if s <= step and v >= 0.5)
    assert step == 36 and count == 17  # 2^16 halved 17 times: 2^-1
    assert finding.title == (
        f"the loss scale is not usable: {count} of {step + 1} steps skipped since step 0, scale 2^16 -> 2^-1 "
        f"(the scale fell to 2^-1, below 1, after calibration ended at step 9: {count} of the last "
        f"{step + 1} steps overflowed)"
    )
    assert finding.evidence["skipped"] == count and finding.evidence["calibration_steps"] == step + 1
    # Skips are no "init_scale below 1": the incident names the overflows.
    diagnosis = diagnose(
        [
            {
                "rule": "scaler_calibration",
                "title": finding.title,
                "step": step,
                "severity": "critical",
                "evidence": finding.evidence,
            }
        ],
        RunContext(fp16_scaler=True),
    )
    assert diagnosis.cause_key != "scale_set_below_one" and "without any overflow" not in diagnosis.title

    # A scale set below 1 (init_scale) with no overflow is still told as such.
    steps = Scaler(init_scale=2.0**-4).run("." * 12)
    [(step, finding), *_] = _findings_however_batched("scaler_calibration", steps)
    assert step == 0 and finding.evidence["skipped"] == 0
    assert finding.title == (
        "the loss scale is not usable: 0 of 1 steps skipped since step 0, scale 2^-4 -> 2^-4 (the scale is "
        "2^-4, below 1, without any overflow)"
    )


def _true_drop(steps, step, window):
    """The series' own peak-to-now within the window (after calibration ends at step 9): (ratio, step of
    the peak, step the current scale was reached)."""
    scale = _series(steps, "amp/scale")
    inside = {s: v for s, v in scale.items() if max(step - window, 9) < s <= step}
    peak = max(inside.values())
    peak_step = max(s for s, v in inside.items() if v == peak)
    low_step = min(s for s in inside if all(scale[t] == scale[step] for t in range(s, step + 1)))
    return peak / scale[step], peak_step, low_step


def test_a_scale_drop_names_the_true_peak_and_the_steps_of_the_fall():
    """A growth to 2^17 at step 85, the sawtooth's probe back to 2^16 at 96, then three more skips: the scale
    fell 16x over the 4 skipped steps 96-99 (2^17 -> 2^13), not "8x in N steps" from the probe."""
    scaler = Scaler(growth_interval=86)
    steps = scaler.run("." * 96 + "xxxx" + "." * 30)
    findings = _findings_however_batched("scale_drop", steps)
    assert [s for s, _ in findings] == list(range(99, 130))
    for step, finding in findings:
        ratio, peak_step, low_step = _true_drop(steps, step, 100)
        assert (ratio, peak_step, low_step) == (16, 95, 99)
        assert finding.title == "loss scale fell 2^17 -> 2^13 (16x) at steps 96-99 (4 skipped)"
        assert finding.evidence["skip_steps"] == [96, 97, 98, 99]
        assert finding.evidence["ratio"] == ratio and finding.evidence["values"] == [2.0**17, 2.0**13]
        assert finding.evidence["steps"] == [95, step] and finding.evidence["low_step"] == 99


def test_non_finite_counts_the_whole_run_of_overflows_not_the_evidence_list():
    scaler = Scaler()
    steps = scaler.run("." * 20 + "x" * 134 + "." * 3)
    findings = _findings_however_batched("non_finite", steps)
    step, last = findings[-1]
    norms = _series(steps, "grad/global_norm")
    in_a_row = sum(1 for s in range(20, step + 1) if not math.isfinite(norms[s]))
    assert step == 153 and in_a_row == 134
    assert last.title == (
        "gradient norm is inf: 134 steps in a row overflowed after calibration (steps 20-153) "
        "(first non-finite layer: hidden.weight)"
    )
    assert last.evidence["count"] == 134 and last.evidence["first_step"] == 20
    assert len(last.evidence["steps"]) == 50  # the evidence keeps the last 50; the count is the count
    first_step, first = findings[0]
    assert first_step == 22 and "3 steps in a row" in first.title and "(steps 20-22)" in first.title


def test_loss_non_finite_counts_every_non_finite_loss_not_the_capped_list():
    steps = [StepData(i, 0, scalars={"loss": math.nan if 10 <= i < 303 else 2.0}) for i in range(310)]
    findings = _findings_however_batched("loss_non_finite", steps)
    step, last = findings[-1]
    losses = _series(steps, "loss")
    count = sum(1 for v in losses.values() if not math.isfinite(v))
    assert step == 302 and count == 293
    assert last.title == "the loss is NaN at step 10; 293 non-finite losses so far, last at step 302"
    assert last.evidence["count"] == 293 and len(last.evidence["steps"]) == 50
    assert last.evidence["steps"][0] == 10 and last.evidence["steps"][-1] == 302


def test_a_skip_storm_counts_the_skips_of_its_window_in_the_series():
    """With a window longer than the evidence list, the count is still the series' count; the skips it
    does not judge (calibration, the sawtooth's probe) are counted apart."""
    scaler = Scaler(growth_interval=30)
    steps = scaler.run("xx" + "." * 30 + "x" + "." * 5 + "x" * 70 + "." * 5)
    params = {"count": 4, "window": 200}
    findings = _findings_however_batched("skip_storm", steps, params)
    step, last = findings[-1]
    skipped = _series(steps, "amp/skipped")
    in_window = [s for s, v in skipped.items() if step - 200 < s <= step and v >= 0.5]
    assert step == len(steps) - 1 == 112 and len(in_window) == 73
    assert in_window[:3] == [0, 1, 32]  # calibrating, calibrating, the probe after the growth at step 31
    assert last.title == (
        "70 skipped steps in the last 113 steps, besides 3 while calibrating or right after a growth "
        f"(steps 38-107, scale now {_power(_series(steps, 'amp/scale')[step])})"
    )
    assert _series(steps, "amp/scale")[step] == 2.0**-56
    assert last.evidence["count"] == 70 and last.evidence["steps"] == list(range(58, 108))


def test_a_collapsed_scale_is_no_setup_mistake_and_says_how_many_steps_overflowed():
    """The agent reports `scale_below_one` wherever the scale falls below 1; when the GradScaler took it
    there by backing off from overflows, that is not a setup mistake."""
    steps = _zero_grad_collapse()
    below = next(d for d in steps if d.scalars["amp/scale"] < 1)
    below.events.append(("scale_below_one", {"scale": below.scalars["amp/scale"], "hint": "look for inf"}))
    assert _findings_however_batched("misuse", steps) == []
    [(step, floor), *_] = _findings_however_batched("scale_floor", steps)
    assert step == below.step == 36
    assert floor.title == (
        "loss scale 2^-1 is below the floor 1 (below 1: gradients overflow even unscaled): 17 of the last 37 "
        "steps overflowed"
    )
    assert floor.evidence["overflowed"] == 17 and floor.evidence["recent_steps"] == 37

    # A scale set below 1 (init_scale) is a setup mistake.
    steps = Scaler(init_scale=2.0**-4).run("." * 5)
    steps[0].events.append(("scale_below_one", {"scale": 2.0**-4, "hint": "use init_scale >= 1"}))
    [(step, finding)] = _findings_however_batched("misuse", steps)
    assert step == 0 and finding.title == "setup mistake: scale below one (first at step 0)"


@pytest.mark.parametrize(
    ("rule_type", "key", "value", "expected"),
    [
        (
            "update_ratio",
            "update/ratio",
            0.5,
            "update ratio of layer0 is 0.5, outside [1e-06, 0.01] (and 29 more layers)",
        ),
        (
            "not_learning",
            "update/rounded_away_frac",
            0.9,
            (
                "weights of 30 of 30 layers stopped changing: 90% of "
                "layer0's updates were rounded away (or the learning rate is 0)"
            ),
        ),
    ],
)
def test_layer_counts_are_every_layer_not_the_evidence_list(rule_type, key, value, expected):
    layers = [f"layer{i}" for i in range(30)]
    steps = [StepData(i, 0, scalars={"amp/skipped": 0.0}, vectors={key: [value] * 30}) for i in range(3)]
    verdicts, _ = feed_batches(make_rule(rule_type), steps, [], layers=layers)
    _, finding = findings_of(verdicts)[-1]
    assert finding.title == expected and finding.evidence["count"] == 30
    assert len(finding.evidence["layers"]) == 20


# -- end to end: the same steps, cut two ways --------------------------------------------------------


def _wire_steps():
    """A run's steps as the agent records them: 30 clean steps, 6 overflowing ones with a finite loss,
    25 clean, 3 with a NaN loss, 20 clean."""
    scaler = Scaler()
    steps = scaler.run("." * 30 + "x" * 6 + "." * 25)
    steps += scaler.run("xxx", loss=math.nan)
    steps += scaler.run("." * 20)
    for data in steps:
        data.scalars["amp/loss"] = data.scalars["loss"]
    return steps


def _batch(seq, parts):
    """A wire batch from (step, scalars, events) parts."""
    series: dict[str, tuple[list, list]] = {}
    events = []
    for step, scalars, step_events in parts:
        for key, value in scalars.items():
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(value if math.isfinite(value) else ("NaN" if math.isnan(value) else "Infinity"))
        events += [{"step": step, "kind": kind, "data": data} for kind, data in step_events]
    return {
        "seq": seq,
        "layers": list(LAYERS),
        "scalars": [{"key": k, "steps": s, "values": v} for k, (s, v) in series.items()],
        "events": events,
    }


def _by_whole_steps(steps, size):
    return [
        _batch(seq, [(d.step, d.scalars, d.events) for d in steps[lo : lo + size]])
        for seq, lo in enumerate(range(0, len(steps), size))
    ]


def _as_the_agent_cuts(steps):
    """One batch per step, as a flush between run.log(loss) and the step's backward makes them: the next
    step's loss ends each batch, the rest of that step begins the next one."""
    batches = []
    for seq, data in enumerate(steps):
        rest = {k: v for k, v in data.scalars.items() if k != "loss"}
        parts = [(data.step, rest if seq else data.scalars, data.events)]
        if seq + 1 < len(steps):
            parts.append((steps[seq + 1].step, {"loss": steps[seq + 1].scalars["loss"]}, []))
        batches.append(_batch(seq, parts))
    return batches


def _post(client, project, batches):
    run = client.post("/api/v1/runs", json={"project": project}).json()
    for batch in batches:
        response = client.post(f"/api/v1/runs/{run['id']}/batches", json=batch)
        assert response.status_code == 200, response.text
    alerts = client.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["data"]
    return run["id"], {
        a["type"]: (
            a["title"],
            a["step"],
            a["last_step"],
            {k: v for k, v in a["evidence"].items() if k != "link"},
        )
        for a in alerts
    }


def _stored(client, run_id, key):
    series = client.get(f"/api/v1/runs/{run_id}/series", params={"key": key, "max_points": 10_000}).json()
    return dict(zip(series["steps"], series["values"], strict=True))


def test_the_same_steps_cut_two_ways_give_the_same_alerts_with_the_series_counts(api_server):
    steps = _wire_steps()
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        whole, by_steps = _post(client, "cuts", _by_whole_steps(steps, 10))
        cut, as_agent = _post(client, "cuts", _as_the_agent_cuts(steps))
        assert as_agent == by_steps
        for run_id in (whole, cut):
            assert _stored(client, run_id, "amp/skipped") == _series(steps, "amp/skipped")
        skipped = _stored(client, cut, "amp/skipped")
        scale = _stored(client, cut, "amp/scale")
        norms = _stored(client, cut, "grad/global_norm")
        losses = _stored(client, cut, "loss")
    assert {"non_finite", "skip_storm", "scale_drop", "loss_non_finite"} <= set(by_steps)

    title, step, last_step, evidence = by_steps["non_finite"]
    overflowed = [s for s in range(30, 36) if not isinstance(norms[s], float)]
    assert len(overflowed) == evidence["count"] == 6 and (step, last_step) == (32, 35)
    assert title.startswith(
        "gradient norm is inf: 6 steps in a row overflowed after calibration (steps 30-35)"
    )

    title, step, last_step, evidence = by_steps["skip_storm"]  # the evidence is the latest finding's
    window = [s for s, v in skipped.items() if last_step - 50 < s <= last_step and v == 1]
    assert (step, last_step) == (33, 83) and evidence["count"] == len(window) == 5
    assert evidence["steps"] == window == [34, 35, 61, 62, 63]
    assert title == f"5 skipped steps in the last 50 steps (steps 34-63, scale now {_power(scale[63])})"

    title, step, last_step, evidence = by_steps["scale_drop"]
    peak = max(v for s, v in scale.items() if max(last_step - 100, 9) < s <= last_step)
    peak_step = max(s for s, v in scale.items() if s <= last_step and v == peak)
    assert evidence["ratio"] == peak / scale[last_step] and evidence["steps"] == [peak_step, last_step]
    assert title.startswith(f"loss scale fell {scale_change(peak, scale[last_step])} at steps ")

    title, _, _, evidence = by_steps["loss_non_finite"]
    bad = [s for s, v in losses.items() if not isinstance(v, float) or not math.isfinite(v)]
    assert bad == [61, 62, 63] and evidence["count"] == 3
    assert title == "the loss is NaN at step 61; 3 non-finite losses so far, last at step 63"


def test_a_run_that_ends_on_part_of_a_step_has_that_step_evaluated(api_server):
    """The part of a step that ends a batch waits for the rest of the step; when the run ends instead,
    the run's end evaluates it."""
    steps = Scaler().run("." * 20)
    batch = _batch(0, [(d.step, d.scalars, d.events) for d in steps])
    batch["scalars"] += [{"key": "loss", "steps": [20], "values": ["NaN"]}]
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        run = client.post("/api/v1/runs", json={"project": "end"}).json()
        for body in (batch, {"seq": 1, "status": "finished"}):
            assert client.post(f"/api/v1/runs/{run['id']}/batches", json=body).status_code == 200
        alerts = client.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["data"]
    [nan] = [a for a in alerts if a["type"] == "loss_non_finite"]
    assert nan["step"] == 20 and nan["title"] == "the loss is NaN at step 20"


def _power(value):
    return f"2^{int(math.log2(value))}"
