"""The two pathologies of issue 29 as rules and diagnoses, as pure functions of steps: layers that get
gradients but are not in the optimizer (the agent's params_not_in_optimizer event, read by the misuse
rule) and one layer whose update ratio is far above every other layer's (update_ratio_outlier), with
the healthy look-alikes that must stay silent. End to end (real training, real server) in
tests/system/test_pathologies.py."""

import json
import math

from rule_steps import feed, findings_of, first_finding

from gradwatch.server.alerts.diagnosis import RunContext, diagnose
from gradwatch.server.alerts.rules import CLEAR, DEFAULT_RULES, StepData, make_rule

LAYERS = [
    "embed.weight",
    "norm.weight",
    "norm.bias",
    "hidden.weight",
    "hidden.bias",
    "mix.weight",
    "out.weight",
]


def ratios(step, embed, weights=0.05, bias=0.5, norm=0.001):
    """An update/ratio row over LAYERS: the embedding's, the 2-D weights', the biases', LayerNorm's."""
    row = [embed, norm, bias, weights, bias, weights * 1.1, weights * 0.9]
    return StepData(step, 0, vectors={"update/ratio": row})


def as_document(finding, rule):
    return {
        "rule": rule,
        "title": finding.title,
        "step": finding.step,
        "severity": "warning",
        "evidence": json.loads(json.dumps(finding.evidence)),
    }


# -- update_ratio_outlier -----------------------------------------------------------------------------


def test_an_embedding_with_a_100x_learning_rate_is_named_with_exact_numbers():
    rule = make_rule("update_ratio_outlier")
    steps = [ratios(0, embed=4.9, bias=math.inf), ratios(20, embed=0.09, bias=0.08)]
    verdicts, _ = feed(rule, steps, LAYERS, round_trip=True)
    [(step, finding)] = findings_of(verdicts)
    # Compared: embed, norm.weight and the three 2-D weights (the zero-initialised biases are left out).
    median = sorted([4.9, 0.001, 0.05, 0.055, 0.045])[2]
    assert step == 0 and median == 0.05
    assert (
        finding.title == "update ratio of embed.weight is 98x the median layer's (4.9 vs 0.05 over 5 layers)"
    )
    assert finding.evidence["layers"] == ["embed.weight"]
    assert finding.evidence["factors"] == [4.9 / 0.05]
    assert finding.cause == "update_ratio_outlier"
    assert verdicts[1] == (20, None)  # fired: stays (the lr is still wrong when the ratios even out)


def test_zero_initialised_layers_layernorm_and_a_uniform_warmup_stay_silent():
    rule = make_rule("update_ratio_outlier")
    steps = [
        ratios(0, embed=0.05, bias=math.inf),  # zero-initialised biases: infinite at the first step
        ratios(20, embed=0.04, bias=2.0),  # then 40x the weights' while they grow from zero
        ratios(40, embed=0.03, bias=0.9),
        *(ratios(s, embed=0.02 * f, weights=0.02 * f, bias=0.1 * f) for s, f in ((60, 0.1), (80, 1.0))),
    ]
    verdicts, _ = feed(rule, steps, LAYERS)
    assert findings_of(verdicts) == []
    assert all(v is CLEAR for _, v in verdicts)


def test_a_class_of_small_init_layers_spread_over_a_range_is_not_one_layer_set_apart():
    """Two LoRA B matrices initialised small: 40x and 25x the A matrices'; neither stands apart."""
    rule = make_rule("update_ratio_outlier")
    layers = ["q.lora_A", "q.lora_B", "v.lora_A", "v.lora_B", "k.lora_A", "k.lora_B"]
    row = [0.001, 0.04, 0.0012, 0.025, 0.0009, 0.0011]
    verdicts, _ = feed(rule, [StepData(0, 0, vectors={"update/ratio": row})], layers)
    assert findings_of(verdicts) == []
    # The same layers with one B alone far above: named.
    row = [0.001, 0.1, 0.0012, 0.0011, 0.0009, 0.0011]
    verdicts, _ = feed(rule, [StepData(0, 0, vectors={"update/ratio": row})], layers)
    assert first_finding(verdicts).evidence["layers"] == ["q.lora_B"]


def test_too_few_layers_or_several_outliers_are_not_judged_and_observations_are_consecutive():
    few = make_rule("update_ratio_outlier")
    verdicts, _ = feed(few, [StepData(0, 0, vectors={"update/ratio": [1.0, 0.01, 0.01]})], LAYERS)
    assert findings_of(verdicts) == []
    rule = make_rule("update_ratio_outlier", {"observations": 2})
    steps = [ratios(0, embed=4.9), ratios(20, embed=0.05), ratios(40, embed=3.0), ratios(60, embed=3.0)]
    verdicts, _ = feed(rule, steps, LAYERS)
    assert [step for step, _ in findings_of(verdicts)] == [60]


def test_a_layer_once_nan_is_compared_again_once_finite():
    """NaN weights (then a resume from a checkpoint before them) are no zero-initialised layer: the
    layer is left out of that observation only, and its 100x learning rate is still named later."""
    rule = make_rule("update_ratio_outlier")
    steps = [ratios(0, embed=math.nan), ratios(20, embed=4.9)]
    verdicts, _ = feed(rule, steps, LAYERS)
    [(step, finding)] = findings_of(verdicts)
    assert step == 20 and finding.evidence["layers"] == ["embed.weight"]


def test_update_ratio_outlier_is_a_default_rule_and_validates():
    assert "update_ratio_outlier" in DEFAULT_RULES
    for params, message in (({"factor": 1}, "factor must be greater than 1"), ({"gap": 0.5}, "at least 1")):
        try:
            make_rule("update_ratio_outlier", params)
        except ValueError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(params)


# -- params_not_in_optimizer --------------------------------------------------------------------------

UNHELD = {
    "layers": ["encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"],
    "count": 4,
    "elements": 5248,
    "gradient_elements": 5508,
    "fraction": 5248 / 5508,
}


def test_the_misuse_rule_names_the_layers_not_in_the_optimizer_and_their_share():
    rule = make_rule("misuse")
    verdicts, _ = feed(rule, [StepData(12, 0, events=[("params_not_in_optimizer", dict(UNHELD))])], LAYERS)
    finding = first_finding(verdicts)
    assert finding.title == (
        "setup mistake: 4 layers (95% of the weights) get gradients but are not in the optimizer: "
        "encoder.0.weight, encoder.0.bias, encoder.2.weight… (first at step 12)"
    )
    assert finding.cause == "params_not_in_optimizer"
    assert finding.evidence["layers"] == UNHELD["layers"]
    assert "build the optimizer after unfreezing" in finding.evidence["hints"][0]
    # One layer, a share that rounds to 100% is not called 100%.
    rule = make_rule("misuse")
    one = {"layers": ["body.weight"], "count": 1, "fraction": 0.9996}
    verdicts, _ = feed(rule, [StepData(3, 0, events=[("params_not_in_optimizer", one)])], LAYERS)
    assert first_finding(verdicts).title == (
        "setup mistake: 1 layer (>99% of the weights) gets a gradient but is not in the optimizer: "
        "body.weight (first at step 3)"
    )


def test_the_incident_names_the_mechanism_and_the_fix():
    rule = make_rule("misuse")
    verdicts, _ = feed(rule, [StepData(12, 0, events=[("params_not_in_optimizer", dict(UNHELD))])], LAYERS)
    diagnosis = diagnose([as_document(first_finding(verdicts), "misuse")], RunContext())
    assert diagnosis.cause_key == "params_not_in_optimizer"
    assert diagnosis.title == (
        "4 layers (95% of the weights) get gradients but are not in the optimizer: "
        "encoder.0.weight, encoder.0.bias, encoder.2.weight…"
    )
    assert diagnosis.layers == UNHELD["layers"]
    assert "model.parameters()" in diagnosis.next_steps[0]
    assert "requires_grad_(False)" in diagnosis.next_steps[1]

    outlier = make_rule("update_ratio_outlier")
    verdicts, _ = feed(outlier, [ratios(0, embed=4.9, bias=math.inf)], LAYERS)
    diagnosis = diagnose([as_document(first_finding(verdicts), "update_ratio_outlier")], RunContext())
    assert diagnosis.cause_key == "update_ratio_outlier"
    assert diagnosis.title == (
        "the update ratio of embed.weight is 98x the median layer's: its learning rate is likely 98x "
        "the others'"
    )
    assert "param group holding embed.weight" in diagnosis.next_steps[0]
    assert diagnosis.layers == ["embed.weight"]
