"""loss_divergence: the loss leaving the range it had reached, finite (issue 38). Rules are pure
functions of steps (rule_steps.feed), fed as the engine feeds them."""

import math
import random

from rule_steps import feed, feed_batches, findings_of

from gradwatch.server.alerts.rules import CLEAR, StepData, make_rule


def _steps(losses, lrs=None, norms=None):
    steps = []
    for i, loss in enumerate(losses):
        scalars = {"loss": loss}
        if lrs is not None:
            scalars["lr"] = lrs[i]
        if norms is not None:
            scalars["grad/global_norm"] = norms[i]
        steps.append(StepData(i, 0, scalars=scalars))
    return steps


def _gradual_divergence():
    """The issue's post-LayerNorm run: the loss falls from 4 to a best of 0.26, climbs over 100 steps
    to 5.2 as the gradient norm rises, then stays near 2.4 for the rest of the run: finite throughout."""
    noise = random.Random(0)
    losses = [0.26 + 3.74 * math.exp(-i / 30) for i in range(150)]
    losses += [0.26 + 4.94 * (i + 1) / 100 for i in range(100)]
    losses += [2.4 for _ in range(150)]
    losses = [v * (1 + 0.03 * noise.uniform(-1, 1)) for v in losses]
    norms = [1.0] * 150 + [1.0 + 20 * (i + 1) / 100 for i in range(100)] + [15.0] * 150
    return losses, norms


def test_a_gradual_finite_divergence_opens_when_the_loss_leaves_its_range_naming_what_rose():
    losses, norms = _gradual_divergence()
    steps = _steps(losses, lrs=[1e-3] * len(losses), norms=norms)
    for verdicts in (
        feed(make_rule("loss_divergence"), steps)[0],
        feed_batches(make_rule("loss_divergence"), steps, [160, 200])[0],
    ):
        step, finding = findings_of(verdicts)[0]
        # the median of 5 passes 3 x 0.26 about 12 steps into the climb, long before the loss tops out
        assert 150 < step < 175, step
        evidence = finding.evidence
        assert evidence["ratio"] >= 3 and evidence["onset_step"] == step - 2  # out of range for 3 steps
        assert 150 < evidence["rising_step"] < evidence["onset_step"]  # half way out: 2x the best
        assert evidence["values"][0] < 0.3 and "the gradient norm rose" in finding.title
        assert all(v is not CLEAR for _, v in verdicts if _ > step)  # it stays out of range: no clear


def test_healthy_loss_curves_stay_silent():
    noise = random.Random(1)
    n = 400
    cases = {
        # near convergence, the noise is large against the loss itself (0.005 -> 0.02), not against the way
        # it came down from 2.3
        "converged_noise": [
            max(0.002, 2.3 * math.exp(-i / 20) + 0.005 + 0.015 * noise.random()) for i in range(n)
        ],
        # hard batches: single steps 10x the level that recover at once
        "bumps": [(0.3 + 2 * math.exp(-i / 30)) * (10 if i % 37 == 0 and i > 50 else 1) for i in range(n)],
        # a cosine schedule decaying to 0: the loss flattens, never climbs
        "cosine": [0.5 + 3 * math.exp(-i / 60) * (1 + 0.05 * noise.uniform(-1, 1)) for i in range(n)],
        # batch-size-1 fine-tuning: a flat loss with heavy-tailed noise (exponential), 1,000 steps
        "heavy_tailed": [0.4 + noise.expovariate(1 / 0.3) for i in range(1000)],
        # a loss below zero (an ELBO, a reward): no ratio to its minimum
        "negative": [-1 - i / 100 + 0.5 * math.sin(i / 7) for i in range(n)],
    }
    for name, losses in cases.items():
        assert findings_of(feed(make_rule("loss_divergence"), _steps(losses))[0]) == [], name


def test_a_scheduled_restart_may_raise_the_loss_while_it_stays_below_the_first_level():
    """SGDR: the lr goes back up to its earlier peak at step 200, the loss rises 4x its best for a while
    and falls again; only a climb above where the run began would count during the grace."""
    lrs = [1e-3 * (1 + math.cos(math.pi * (i % 200) / 200)) / 2 + 1e-6 for i in range(400)]
    losses = [0.25 + 3 * math.exp(-i / 25) for i in range(200)]
    losses += [0.25 + 0.9 * math.exp(-i / 40) for i in range(200)]
    assert findings_of(feed(make_rule("loss_divergence"), _steps(losses, lrs=lrs))[0]) == []
    worse = losses[:200] + [4.0 + 0.1 * i for i in range(200)]  # past the first level: it counts
    assert findings_of(feed(make_rule("loss_divergence"), _steps(worse, lrs=lrs))[0])


def test_it_clears_when_the_loss_is_back_in_range():
    losses = [0.2 + 3 * math.exp(-i / 10) for i in range(60)] + [2.0] * 10 + [0.25] * 20
    verdicts, _ = feed(make_rule("loss_divergence"), _steps(losses))
    opened = findings_of(verdicts)[0][0]
    assert 60 <= opened < 70
    assert any(v is CLEAR for s, v in verdicts if s > opened)


def test_the_users_loss_and_the_divided_amp_loss_never_mix_in_one_range():
    """nanoGPT under fp16 logs its loss after the step, so step 0 holds only amp/loss (the loss passed to
    scaler.scale, divided by 4 micro-batches) and "loss" starts at step 1, 4x higher: no divergence."""
    steps = [StepData(0, 0, scalars={"amp/loss": 1.04})]
    for i in range(1, 120):
        level = 1.0 + 3.0 * math.exp(-i / 40)
        steps.append(StepData(i, 0, scalars={"amp/loss": level / 4, "loss": level}))
    assert findings_of(feed(make_rule("loss_divergence"), steps)[0]) == []
    # amp/loss alone (no run.log) is judged as it is
    alone = [StepData(i, 0, scalars={"amp/loss": 0.25 if i < 60 else 1.5}) for i in range(90)]
    assert findings_of(feed(make_rule("loss_divergence"), alone)[0])


# -- divergence_warning: the precursors, ahead of the loss leaving its range -------------------------


def _first(rule, steps):
    found = findings_of(feed(make_rule(rule), steps)[0])
    return found[0] if found else (None, None)


def test_a_climb_with_a_growing_gradient_norm_is_warned_at_least_5_steps_before_the_loss_leaves_its_range():
    losses, norms = _gradual_divergence()
    steps = _steps(losses, lrs=[1e-3] * len(losses), norms=norms)
    warned, warning = _first("divergence_warning", steps)
    left, _ = _first("loss_divergence", steps)
    assert warned is not None and left is not None and left - warned >= 5, (warned, left)
    assert warning.title.startswith("divergence ahead: loss ") and "the gradient norm rose" in warning.title
    # the same climb with a flat gradient norm and lr: no precursor, no warning (loss_divergence still comes)
    flat = _steps(losses, lrs=[1e-3] * len(losses), norms=[1.0] * len(losses))
    assert _first("divergence_warning", flat) == (None, None) and _first("loss_divergence", flat)[0] == left


def test_an_lr_past_the_peak_the_run_settled_on_is_warned_at_once_but_warm_up_and_restarts_are_not():
    warm_cosine = [
        1e-3 * min(1, (i + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * max(i - 50, 0) / 300))
        for i in range(350)
    ]
    losses = [0.3 + 3 * math.exp(-i / 40) for i in range(350)]
    assert _first("divergence_warning", _steps(losses, lrs=warm_cosine)) == (None, None)
    sgdr = warm_cosine[:200] + warm_cosine[50:200]  # back to the same peak at step 200: healthy
    assert _first("divergence_warning", _steps(losses[:350], lrs=sgdr[:350])) == (None, None)
    mistyped = warm_cosine[:200] + [100 * v for v in warm_cosine[50:200]]  # a restart to 100x the peak
    step, finding = _first("divergence_warning", _steps(losses[:350], lrs=mistyped[:350]))
    assert step == 200 and finding.evidence["key"] == "lr" and finding.evidence["ratio"] > 2
    assert "settled on" in finding.title


def test_healthy_loss_curves_raise_no_warning_either():
    noise = random.Random(1)
    n = 400
    for name, losses in {
        "converged_noise": [
            max(0.002, 2.3 * math.exp(-i / 20) + 0.005 + 0.015 * noise.random()) for i in range(n)
        ],
        "heavy_tailed": [0.4 + noise.expovariate(1 / 0.3) for i in range(1000)],
        "bimodal_batches": [0.01 if noise.random() < 0.7 else 0.3 for i in range(n)],
        "bumps": [(0.3 + 2 * math.exp(-i / 30)) * (10 if i % 37 == 0 and i > 50 else 1) for i in range(n)],
    }.items():
        norms = [1.0 + 3 * noise.random() for _ in losses]  # a noisy gradient norm that does not grow
        assert _first("divergence_warning", _steps(losses, norms=norms)) == (None, None), name


def test_the_warnings_first_precursor_stays_in_its_later_evidence():
    """A restart to 100x the settled peak is warned at once (the lr); when the loss then climbs, that
    finding replaces the first as the alert's evidence, and the incident's title is built from it: the
    lr passing its peak, where it all began, stays in the evidence (it was gone from the card)."""
    warm_cosine = [
        1e-3 * min(1, (i + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * max(i - 50, 0) / 300))
        for i in range(350)
    ]
    lrs = warm_cosine[:200] + [100 * v for v in warm_cosine[50:200]]
    losses = [0.3 + 3 * math.exp(-i / 40) for i in range(200)]
    losses += [losses[-1] * (1 + 4 * (i + 1) / 60) for i in range(150)]  # the climb the lr causes
    norms = [1.0] * 200 + [1.0 + 10 * (i + 1) / 60 for i in range(150)]
    for round_trip in (False, True):  # the state is stored as JSON between batches
        found = findings_of(
            feed(make_rule("divergence_warning"), _steps(losses, lrs, norms), round_trip=round_trip)[0]
        )
        (first_step, first), (last_step, last) = found[0], found[-1]
        assert first_step == 200 and first.evidence["key"] == "lr"
        assert last.evidence["key"] == "loss" and last_step > 200
        assert last.evidence["precursors"][0].startswith("the learning rate rose")
        assert last.evidence["precursors"][0].endswith("past its settled peak (from step 200)")


def test_a_warm_up_that_leaves_its_range_within_tens_of_steps_is_seen_there():
    """A ramp to too high a peak: the loss falls from 4.2 to ~1 in 20 steps and is back at 3.3 by step 30.
    The best level used to be looked for only once 45 losses were in (by then the loss was already out,
    and its best was the diverged level: silent for good); it is looked for from `baseline` losses on,
    and the noise's reach above it is read around the fall's trend, not from the fall's first steps."""
    losses = [0.8 + 3.4 * math.exp(-i / 6) for i in range(25)] + [0.9 + 0.4 * i for i in range(1, 7)]
    losses += [3.3 * (1 + 0.05 * math.sin(i)) for i in range(100)]
    norms = [1.0] * 25 + [6.0] * 106
    lrs = [2e-2 * min(1.0, (i + 1) / 30) for i in range(len(losses))]
    left, finding = _first("loss_divergence", _steps(losses, lrs, norms))
    assert left is not None and left < 40, left
    assert finding.evidence["values"][0] < 1.2 and "the gradient norm rose" in finding.title
    warned, _ = _first("divergence_warning", _steps(losses, lrs, norms))
    assert warned is not None and warned < left


def _edge_of_stability(lrs, norm_from=79, loss_from=88):
    """A loss that has settled near 0.7 (small noise), a gradient norm that jumps 4x at `norm_from` (its
    spikes come more and more often as the lr ramps past what the model takes) and a loss that climbs to
    3x from `loss_from` on."""
    noise = random.Random(2)
    losses = [0.7 + 3 * math.exp(-i / 8) + 0.05 * noise.random() for i in range(loss_from)]
    losses += [0.75 * (1 + 0.5 * (i + 1)) for i in range(40)]
    norms = [1.0 + 0.2 * noise.random() for _ in range(norm_from)] + [4.0] * (len(losses) - norm_from)
    return _steps(losses, lrs[: len(losses)], norms)


def test_the_gradient_norm_climbing_while_the_lr_ramps_is_warned_before_the_loss_follows():
    ramp = [2e-2 * min(1.0, (i + 1) / 100) for i in range(128)]
    warned, warning = _first("divergence_warning", _edge_of_stability(ramp))
    left, _ = _first("loss_divergence", _edge_of_stability(ramp))
    assert warned is not None and warned <= 81, warned  # 3 of the last 5 norms up
    assert left is not None and left - warned >= 5, (warned, left)
    assert warning.evidence["precursors"][0].startswith("the gradient norm rose")
    assert "the learning rate rose" in " ".join(warning.evidence["precursors"])
    # the norm alone, the loss still falling: no climb (a warm-up's early steps)
    falling = _steps([4.0 * math.exp(-i / 60) for i in range(128)], ramp, [1.0] * 79 + [4.0] * 49)
    assert _first("divergence_warning", falling) == (None, None)


def test_a_norm_that_grows_as_the_lr_decays_or_spikes_once_raises_no_warning():
    """The gradient norm often grows as a cosine schedule takes the lr to 0, with the loss flat: not a
    divergence (the lr is below its value at the best step). A lone spike every 10 steps (hard batches)
    is not a climb (the median of 5)."""
    noise = random.Random(3)
    cosine = [1e-3 * (0.5 + 0.5 * math.cos(math.pi * i / 300)) for i in range(300)]
    losses = [0.5 + 3 * math.exp(-i / 30) + 0.02 * noise.random() for i in range(300)]
    grows = [1.0] * 200 + [4.0] * 100
    assert _first("divergence_warning", _steps(losses, cosine, grows)) == (None, None)
    flat_lr = [1e-3] * 300
    spikes = [8.0 if i % 10 == 0 else 1.0 for i in range(300)]
    assert _first("divergence_warning", _steps(losses, flat_lr, spikes)) == (None, None)
