"""Each per-step quantity checked against a plain-autograd reference on a tiny model."""

import math
import os
import random
import signal
import time

import pytest
import torch
from torch import nn
from training import RecordingTransport, Reference, TinyNet, train

import gradwatch
from gradwatch import _quantities as q


def _run(transport):
    return gradwatch.init(project="q", transport=transport)


def _one_step(options, precision="fp16", clip=True, capture=None):
    """One fp16/bf16 step on TinyNet with gradwatch; returns the transport and what the test saw."""
    torch.manual_seed(1)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if precision == "fp16" else None
    transport = RecordingTransport()
    seen = {}
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler, **options)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if clip:
            seen["clip_return"] = nn.utils.clip_grad_norm_(model.parameters(), 0.01).item()
            seen["post_clip"] = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        seen["after"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen["names"] = [n for n, _ in model.named_parameters()]
    return transport, seen


def test_per_layer_grad_and_param_norms_match_autograd():
    transport, seen = _one_step({"layer_norms_every": 1})
    assert transport.layers() == seen["names"]
    grad_norms = transport.vectors("grad/norm")[0]
    param_norms = transport.vectors("param/norm")[0]
    for i, name in enumerate(seen["names"]):
        assert grad_norms[i] == pytest.approx(seen["grads"][name].norm().item(), rel=1e-6)  # pre-clip
        assert param_norms[i] == pytest.approx(seen["after"][name].norm().item(), rel=1e-6)


def test_global_norm_reuses_clip_and_post_clip_is_derived():
    transport, seen = _one_step({"layer_norms_every": 0})
    assert transport.series("grad/global_norm")[0] == pytest.approx(seen["clip_return"], rel=1e-6)
    assert transport.series("grad/global_norm_post_clip")[0] == pytest.approx(seen["post_clip"], rel=1e-4)


def test_global_norm_without_clip_is_computed():
    transport, seen = _one_step({"layer_norms_every": 0}, clip=False)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen["grads"].values()])).item()
    assert transport.series("grad/global_norm")[0] == pytest.approx(expected, rel=1e-6)


def test_update_ratio_matches_autograd():
    transport, seen = _one_step({"update_ratio_every": 1}, precision="bf16")
    ratios = transport.vectors("update/ratio")[0]
    for i, name in enumerate(seen["names"]):
        before, after = seen["before"][name], seen["after"][name]
        assert ratios[i] == pytest.approx(((after - before).norm() / before.norm()).item(), rel=1e-5)


def test_histograms_match_a_per_element_reference_and_count_every_value():
    tensors = [
        torch.tensor(
            [0.0, -0.0, 1.0, -1.5, 3e-8, float("nan"), float("inf"), -float("inf"), 2.0**-100, 2.0**60]
        ),
        torch.tensor([1e-40, 2.0**-126, -(2.0**-127)], dtype=torch.float32),  # fp32 subnormals count as zeros
        torch.zeros(5),
        torch.full((4,), float("nan")),  # all-NaN: counted, never a crash
        None,
    ]
    rows = q.log2_histograms(tensors, torch.zeros(())).tolist()
    for tensor, row in zip(tensors, rows, strict=True):
        expected = [0] * (q.N_BINS + 2)
        for value in [] if tensor is None else tensor.tolist():
            if not math.isfinite(value):
                expected[q.NON_FINITE_COLUMN] += 1
            elif abs(value) < 2.0**-126:
                expected[q.ZERO_COLUMN] += 1
            else:
                exponent = min(max(math.frexp(abs(value))[1], q.EXPONENT_MIN), q.EXPONENT_MAX)
                expected[exponent - q.EXPONENT_MIN] += 1
        assert row == expected
        assert sum(row) == (0 if tensor is None else tensor.numel())


def test_fp16_fractions_match_brute_force():
    rng = random.Random(0)
    values = [rng.choice([-1, 1]) * 2.0 ** rng.uniform(-45, 5) for _ in range(5_000)]
    row = q.log2_histograms([torch.tensor(values)], torch.zeros(())).tolist()[0]
    for scale in (1.0, 2.0**8, 2.0**16, 2.0**24):
        under, precision, over = q.fp16_fractions(row, scale)
        assert under == sum(abs(v * scale) < 2.0**-24 for v in values) / len(values)
        assert precision == sum(abs(v * scale) < 2.0**-14 for v in values) / len(values)
        assert over == sum(abs(v * scale) > 65504 for v in values) / len(values)


def test_safe_scale_band_is_conservative():
    values = [3e-7, -0.02, 5.0]
    row = q.log2_histograms([torch.tensor(values)], torch.zeros(())).tolist()[0]
    low, high = q.safe_scale_band([row])
    assert low >= 2.0**-24 / min(map(abs, values))
    assert high <= 65504 / max(map(abs, values))
    assert low < high


def test_histograms_and_fractions_travel_with_the_run():
    transport, seen = _one_step({"histograms_every": 1})
    histogram = transport.histograms()[0]
    assert len(histogram["counts"]) == len(seen["names"])
    for name, counts in zip(seen["names"], histogram["counts"], strict=True):
        assert sum(counts) == seen["grads"][name].numel()
    under = transport.vectors("grad/underflow_frac")[0]
    assert len(under) == len(seen["names"]) and all(0 <= f <= 1 for f in under)
    low = transport.series("amp/safe_scale_min")[0]
    high = transport.series("amp/safe_scale_max")[0]
    assert 0 < low < high


def test_skipped_steps_are_excluded_from_update_ratios():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(8, run=run, overflow_steps=(3,), watch_options={"update_ratio_every": 1})
    assert 3 not in transport.vectors("update/ratio")
    assert {0, 1, 2, 4} <= set(transport.vectors("update/ratio"))


def test_skip_detection_with_a_fused_optimizer():
    """A fused optimizer's skip is known on the device only; its skipped steps still get their
    per-layer norms (NaN/Inf, never dropped or 0), and the skip event names the non-finite layers."""
    transport = RecordingTransport()
    reference = Reference()
    with _run(transport) as run:
        options = {"layer_norms_every": 100, "dense_start_steps": 0}  # steps 2 and 5 are not sampled
        train(8, run=run, overflow_steps=(2, 5), fused=True, reference=reference, watch_options=options)
    skipped = [s for s, v in transport.series("amp/skipped").items() if v == 1.0]
    assert skipped == [2, 5]
    skips = transport.events("skip")
    assert [e["step"] for e in skips] == [2, 5]
    assert sorted(transport.vectors("grad/norm")) == [0, 2, 5]
    for event in skips:
        assert event["data"]["non_finite_layers"] == reference.non_finite_layers[event["step"]]
        assert event["data"]["non_finite_layers"]


def test_scaler_update_with_an_explicit_new_scale():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(optimizer)
        scaler.update(1024.0)
    assert transport.series("amp/scale") == {0: 1024.0}


def test_clip_before_unscale_is_reported():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(3, run=run, clip="before_unscale")
    # Told once the cuts of the scaled gradients agree on one max_norm: step 0's rewrite came before
    # any measurement (a division there would be harmless), steps 1 and 2 are measured and agree.
    [event] = transport.events("clip_before_unscale")
    assert event["step"] == 2 and "unscale_" in event["data"]["hint"]
    assert event["data"]["max_norm"] == 1.0


def test_scale_below_one_is_reported_once():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(12, run=run, overflow_steps=tuple(range(1, 10)), init_scale=8.0)
    events = transport.events("scale_below_one")
    assert len(events) == 1 and events[0]["data"]["scale"] < 1


def test_bf16_model_in_fp16_and_oversized_weights_are_reported():
    model = TinyNet()
    with torch.no_grad():
        model.hidden.weight[0, 0] = 1e5
    model.config = type("Config", (), {"torch_dtype": torch.bfloat16})()
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    assert transport.events("bf16_model_in_fp16")
    [event] = transport.events("weights_exceed_fp16")
    assert event["data"]["max_abs_weight"] == 1e5


def test_throughput_from_samples_per_step():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(4, run=run, watch_options={"samples_per_step": 8})
    rates = transport.series("perf/samples_per_sec")
    times = transport.series("perf/step_time")
    assert rates and all(rates[s] == pytest.approx(8 / times[s]) for s in rates)


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_norms_every": -1},
        {"histograms_every": 1.5},
        {"samples_per_step": 0},
        {"dense_start_steps": -5},
    ],
)
def test_watch_options_are_validated(bad):
    run = _run(RecordingTransport())
    with pytest.raises(ValueError, match=next(iter(bad))):
        run.watch(TinyNet(), torch.optim.SGD(TinyNet().parameters(), lr=0.1), **bad)
    run.finish()


def _host_packet():
    """A resolved packet as the sender thread sees it: plain host values, no tensors."""
    from gradwatch._buffer import Resolved

    row = [0] * (q.N_BINS + 2)
    row[-34 - q.EXPONENT_MIN] = 10  # ten gradients with |g| in [2^-35, 2^-34): |g·S| < 2^-24 at S = 1024
    return Resolved(
        scalars={
            "amp/skipped": [(0, 0.0), (1, 1.0)],
            "_amp/scale_before": [(0, 1024.0), (1, 1024.0)],
            "amp/scale": [(0, 1024.0), (1, 0.5)],
            "grad/global_norm": [(0, 4.0), (1, math.inf)],
            # clip_grad_norm_(max_norm=1.0): step 0 cut 4.0 to 1.0, step 1 (inf) made everything NaN
            "grad/global_norm_post_clip": [(0, 4.0 * (1.0 / (4.0 + 1e-6))), (1, math.nan)],
        },
        vectors={"grad/norm": [(1, [1.0, math.nan])], "update/ratio": [(0, [0.1, 0.2]), (1, [0.0, 0.0])]},
        matrices={
            "_update/unchanged_counts": [(0, [[1, 4], [0, 0]]), (1, [[3, 3], [0, 0]])],
            "grad/hist": [(0, [row, row])],
        },
        events=[],
    )


def test_host_derivation_is_a_function_of_host_values():
    from gradwatch import _derive

    resolved = _host_packet()
    assert _derive.derive(resolved, ["a", "b"], loss_scaling=True, partial_norms=False)
    skip, below_one = resolved.events
    assert skip == {
        "step": 1,
        "kind": "skip",
        "data": {
            "scale_before": 1024.0,
            "scale_after": 0.5,
            "non_finite_layers": ["b"],
            "non_finite_layer_count": 1,
        },
    }
    assert below_one["kind"] == "scale_below_one" and below_one["step"] == 1
    assert resolved.layers == ["a", "b"]
    assert resolved.vectors["update/ratio"] == [(0, [0.1, 0.2])], "a skipped step's ratios are dropped"
    [(step, fractions)] = resolved.vectors["update/rounded_away_frac"]
    assert step == 0 and fractions[0] == 0.25 and math.isnan(fractions[1])
    # one cut does not tell a clip's threshold (a division after backward cuts alike): none yet
    assert "grad/clip_max_norm" not in resolved.scalars
    assert resolved.vectors["grad/underflow_frac"] == [(0, [1.0, 1.0])]
    assert resolved.scalars["grad/global_underflow_frac"] == [(0, 1.0)]
    assert resolved.vectors["grad/zero_frac"] == [(0, [0.0, 0.0])]

    unscaled = _host_packet()
    assert (
        _derive.derive(
            unscaled, ["a", "b"], loss_scaling=False, partial_norms=True, report_scale_below_one=False
        )
        is False
    )
    assert [e["kind"] for e in unscaled.events] == ["skip"]
    assert "grad/clip_max_norm" not in unscaled.scalars, "a shard's norms do not give the threshold"
    assert "grad/zero_frac" in unscaled.vectors and "grad/underflow_frac" not in unscaled.vectors


def _norms_packet(pre, post, spread=None, first_step=0, layers=None):
    from gradwatch._buffer import Resolved

    steps = range(first_step, first_step + len(pre))
    scalars = {
        "grad/global_norm": list(zip(steps, pre, strict=True)),
        "grad/global_norm_post_clip": list(zip(steps, post, strict=True)),
    }
    if spread is not None:
        scalars["_grad/rewrite_spread"] = list(zip(steps, spread, strict=True))
    vectors = {"grad/norm": list(zip(steps, layers, strict=True))} if layers is not None else {}
    return Resolved(scalars=scalars, vectors=vectors, matrices={}, events=[])


def _clipped(norm, max_norm):
    return norm * min(1.0, max_norm / (norm + 1e-6))


def test_the_clip_threshold_is_inferred_once_two_cuts_agree_and_carried_across_packets():
    from gradwatch._derive import WatchDerivation

    derivation = WatchDerivation(["a"], loss_scaling=False, partial_norms=False)
    uncut = _norms_packet([0.5, 0.7], [0.5, 0.7])  # a clip ran (the gradients were rewritten) but cut nothing
    derivation(uncut)
    assert "grad/clip_max_norm" not in uncut.scalars  # the threshold is not known yet
    one_cut = _norms_packet([0.5, 3.0], [0.5, _clipped(3.0, 0.25)], first_step=2)
    derivation(one_cut)
    assert "grad/clip_max_norm" not in one_cut.scalars  # one cut could be a division after backward
    pre = [2.0, 0.1, 5.0]
    second = _norms_packet(pre, [_clipped(n, 0.25) for n in pre], first_step=4)
    derivation(second)
    # the first cut (step 3, sent before) gets the threshold its confirmation makes known: a run whose
    # steps travel one packet each starts grad/clip_max_norm at its first cut, as a fast run does
    assert second.scalars["grad/clip_max_norm"] == [(3, 0.25), (4, 0.25), (5, 0.25), (6, 0.25)]
    assert second.scalars["grad/global_norm"] == list(zip(range(4, 7), pre, strict=True)), (
        "a clip's pre-clip norms stay"
    )
    later = _norms_packet([0.1, math.inf], [0.1, math.nan], first_step=7)  # step 8 overflowed
    derivation(later)
    assert later.scalars["grad/clip_max_norm"] == [(7, 0.25), (8, 0.25)]
    assert [e["kind"] for e in uncut.events + one_cut.events + second.events + later.events] == []


def test_a_division_after_backward_is_no_clip_and_its_norms_are_those_after_it():
    """p.grad.div_(4) after the micro-batches: every layer scaled alike by one factor, to norms that
    vary. No max_norm is made up; the norms are those a clip after the division sees."""
    from gradwatch._derive import WatchDerivation

    derivation = WatchDerivation(["a", "b"], loss_scaling=False, partial_norms=False)
    pre = [4.0, 2.0, 8.0, 6.0]
    packet = _norms_packet(pre, [n / 4 for n in pre], spread=[0.0] * 4, layers=[[n, 0.0] for n in pre])
    derivation(packet)
    assert "grad/clip_max_norm" not in packet.scalars
    assert packet.scalars["grad/global_norm"] == [(s, n / 4) for s, n in enumerate(pre)]
    assert packet.vectors["grad/norm"] == [(s, [n / 4, 0.0]) for s, n in enumerate(pre)]
    [event] = packet.events
    assert event["kind"] == "gradients_rescaled" and event["step"] == 1 and event["data"]["factor"] == 0.25
    # A step of 4 micro-batches divided by 4 tells it alone (the first packet of a slow run)
    alone = WatchDerivation(["a", "b"], loss_scaling=False, partial_norms=False)
    first = _norms_packet([4.0], [1.0], spread=[0.0])
    first.scalars["amp/micro_batches"] = [(0, 4.0)]
    alone(first)
    assert first.scalars["grad/global_norm"] == [(0, 1.0)] and "grad/clip_max_norm" not in first.scalars
    # then a clip after the division: the cuts agree on its max_norm, on the divided norms
    pre = [40.0, 4.0, 12.0, 2.0]
    later = _norms_packet(pre, [_clipped(n / 4, 1.5) for n in pre], spread=[0.0] * 4, first_step=4)
    derivation(later)
    assert later.scalars["grad/global_norm"] == [(s + 4, n / 4) for s, n in enumerate(pre)]
    assert later.scalars["grad/clip_max_norm"] == [(s + 4, 1.5) for s in range(4)]
    assert later.events == []


@pytest.mark.parametrize(
    "case",
    ["uneven-layers", "a factor of its own each step"],
)
def test_a_rewrite_that_is_no_clip_by_the_global_norm_gives_no_threshold(case):
    """clip_grad_value_, a hand-written all-reduce or some layers zeroed scale the layers unevenly; a
    division by each step's token count scales them by a factor of its own each step: no clip."""
    from gradwatch._derive import WatchDerivation

    derivation = WatchDerivation(["a", "b"], loss_scaling=False, partial_norms=False)
    pre = [4.0, 2.0, 8.0, 6.0, 3.0]
    if case == "uneven-layers":
        packet = _norms_packet(pre, [1.0] * 5, spread=[0.3] * 5)
    else:
        packet = _norms_packet(pre, [n / t for n, t in zip(pre, [510, 498, 505, 520, 490], strict=True)])
    derivation(packet)
    assert "grad/clip_max_norm" not in packet.scalars
    assert packet.scalars["grad/global_norm"] == list(enumerate(pre)), "the norms backward left"
    kinds = [e["kind"] for e in packet.events]
    assert kinds == (["gradients_rewritten"] if case == "uneven-layers" else [])


def test_a_watch_derivation_reports_the_scale_below_one_once():
    from gradwatch._derive import WatchDerivation

    derivation = WatchDerivation(["a", "b"], loss_scaling=True, partial_norms=False)
    first, second = _host_packet(), _host_packet()
    derivation(first)
    derivation(second)
    assert [e["kind"] for e in first.events] == ["skip", "scale_below_one"]
    assert [e["kind"] for e in second.events] == ["skip"]


def _clip_in_two_parts(parameters, max_norm):
    """Accelerate's way (and so the Hugging Face Trainer's): the total norm, then the clip with it."""
    parameters = list(parameters)
    total = nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _clip_grad_norm(parameters, max_norm):
    return nn.utils.clip_grad_norm_(parameters, max_norm)  # looked up at call time, as users do


def _clipped_fp32_steps(clip_at, scaler=True, inf_at=(), steps=5, clip=_clip_grad_norm):
    """fp32 steps of TinyNet (GradScaler optional) with clip(parameters, max_norm) on the steps in
    `clip_at`; returns the transport, the reference pre-clip per-layer norms of each step, and how
    many times gradwatch computed per-layer norms itself."""
    torch.manual_seed(3)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    transport = RecordingTransport()
    reference = {}
    own_calls = []
    original = q.layer_norms

    def counting_layer_norms(tensors, like, **options):
        own_calls.append(len(tensors))
        return original(tensors, like, **options)

    q.layer_norms = counting_layer_norms
    try:
        with _run(transport) as run:
            run.watch(
                model,
                optimizer,
                scaler=amp_scaler,
                layer_norms_every=1,
                param_norms_every=0,
                histograms_every=0,
                update_ratio_every=0,
            )
            for step in range(steps):
                optimizer.zero_grad()
                x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
                model.blowup = math.inf if step in inf_at else 1.0
                loss = nn.functional.cross_entropy(model(x), y)
                if amp_scaler is not None:
                    amp_scaler.scale(loss).backward()
                    amp_scaler.unscale_(optimizer)
                else:
                    loss.backward()
                reference[step] = [p.grad.norm().item() for p in model.parameters()]
                if step in clip_at:
                    clip(model.parameters(), 0.05)
                if amp_scaler is not None:
                    amp_scaler.step(optimizer)
                    amp_scaler.update()
                else:
                    optimizer.step()
    finally:
        q.layer_norms = original
    return transport, reference, own_calls


@pytest.mark.parametrize("scaler", [True, False], ids=["grad-scaler", "no-scaler"])
def test_per_layer_norms_are_pre_clip_from_one_pass_and_a_clip_costs_one_more(scaler):
    transport, reference, own_calls = _clipped_fp32_steps(clip_at=range(5), scaler=scaler)
    recorded = transport.vectors("grad/norm")
    assert sorted(recorded) == list(range(5))
    for step, norms in recorded.items():
        assert norms == pytest.approx(reference[step], rel=1e-6)  # pre-clip, every layer
    # One pass at the end of each backward (the pre-clip norms), one after the clip rewrote them.
    assert len(own_calls) == 2 * 5


@pytest.mark.parametrize("scaler", [True, False], ids=["grad-scaler", "no-scaler"])
def test_a_clip_in_two_parts_is_seen_with_its_pre_clip_norms(scaler):
    # get_total_norm + clip_grads_with_norm_ (Accelerate's clip) never calls clip_grad_norm_: the
    # norms recorded are still those before the clip, never the clipped gradients' (about 0.05).
    transport, reference, _ = _clipped_fp32_steps(clip_at=range(5), scaler=scaler, clip=_clip_in_two_parts)
    recorded = transport.vectors("grad/norm")
    assert sorted(recorded) == list(range(5))
    global_norms = transport.series("grad/global_norm")
    for step, norms in recorded.items():
        assert norms == pytest.approx(reference[step], rel=1e-6)
        expected = math.sqrt(sum(n * n for n in reference[step]))
        assert global_norms[step] == pytest.approx(expected, rel=1e-5)
        assert expected > 5 * 0.05  # far above max_norm: the clip really scaled the gradients
    assert transport.series("grad/clip_max_norm") == {step: pytest.approx(0.05) for step in range(5)}
    assert transport.series("grad/global_norm_post_clip") == {
        step: pytest.approx(0.05, rel=1e-3) for step in range(5)
    }


def test_a_step_that_stops_clipping_still_records_pre_step_norms():
    # Steps 0-1 clip, step 2 does not (norms wait for a clip that never comes), step 3 clips, step 4
    # overflows (skipped, no optimizer step) without a clip.
    transport, reference, _ = _clipped_fp32_steps(clip_at={0, 1, 3}, inf_at={4})
    recorded = transport.vectors("grad/norm")
    assert sorted(recorded) == list(range(5))
    for step in range(4):
        assert recorded[step] == pytest.approx(reference[step], rel=1e-6)
    assert any(v in ("NaN", "Infinity") for v in recorded[4])  # the overflowing step's, localised
    skips = transport.events("skip")
    assert [e["step"] for e in skips] == [4] and skips[0]["data"]["non_finite_layer_count"] > 0


def test_update_ratios_are_exact_over_consecutive_sampled_steps():
    torch.manual_seed(4)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    transport = RecordingTransport()
    expected = {}
    with _run(transport) as run:
        run.watch(model, optimizer, update_ratio_every=1, layer_norms_every=0, histograms_every=0)
        for step in range(4):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            expected[step] = [
                ((p.detach() - b).norm() / b.norm()).item()
                for p, b in zip(model.parameters(), before, strict=True)
            ]
    recorded = transport.vectors("update/ratio")
    assert sorted(recorded) == list(range(4))
    for step, ratios in recorded.items():
        assert ratios == pytest.approx(expected[step], rel=1e-5)


class ZeroInitialised(nn.Module):
    """A body, a LoRA-style A/B pair with B zero, a zero head, and a zero layer no gradient reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)
        self.head = nn.Linear(8, 4)
        self.dead = nn.Linear(8, 8)
        for zero in (self.lora_b.weight, self.head.weight, self.head.bias, self.dead.weight, self.dead.bias):
            nn.init.zeros_(zero)

    def forward(self, x):
        h = self.body(x) + self.lora_b(self.lora_a(x))
        return self.head(h) + 0 * self.dead(torch.zeros_like(x)).sum()


def test_update_ratio_of_zero_initialised_layers_is_infinite_and_of_non_finite_updates_nan():
    """||dW|| / ||W|| is undefined where W was zero: +inf, whatever the update (0 / 0 too), so the
    dashboard can draw it as such; an update that made the weights non-finite is NaN, never +inf."""
    torch.manual_seed(0)
    model = ZeroInitialised()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    transport = RecordingTransport()
    expected = {}
    with _run(transport) as run:
        run.watch(model, optimizer, update_ratio_every=1, layer_norms_every=0, histograms_every=0)
        for step in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 4, (8,))).backward()
            if step == 2:
                model.body.weight.grad[0, 0] = float("inf")  # SGD makes that weight -inf
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            expected[step] = [
                ((p.detach() - b).norm() / b.norm()).item()
                for p, b in zip(model.parameters(), before, strict=True)
            ]
    names = transport.layers()
    recorded = {
        step: dict(zip(names, row, strict=True)) for step, row in transport.vectors("update/ratio").items()
    }
    plain = {step: dict(zip(names, row, strict=True)) for step, row in expected.items()}
    assert sorted(recorded) == [0, 1, 2]
    # Step 0: the head's weights were zero and moved (||dW|| / 0); B's did not move yet (0 / 0: its
    # gradient passes through the zero head); the dead layer never moves.
    assert (plain[0]["head.weight"], math.isnan(plain[0]["lora_b.weight"])) == (math.inf, True)
    for step, zero in ((0, "lora_b.weight head.weight head.bias"), (1, "lora_b.weight"), (2, "")):
        for name in [*zero.split(), "dead.weight", "dead.bias"]:
            assert recorded[step][name] == "Infinity", (step, name)
    # The weight SGD made -inf: a plain division says +inf, which would read as "the weight was zero".
    assert plain[2]["body.weight"] == math.inf and recorded[2]["body.weight"] == "NaN"
    for step, ratios in recorded.items():
        for name, value in ratios.items():
            if math.isfinite(plain[step][name]):
                assert value == pytest.approx(plain[step][name], rel=1e-5), (step, name)
    assert recorded[1]["head.weight"] > 0 and recorded[2]["lora_b.weight"] > 0  # then ordinary ratios


def test_update_ratios_give_infinity_one_meaning():
    inf, nan, largest = math.inf, math.nan, torch.finfo(torch.float32).max
    update_norms = torch.tensor([0.5, 0.0, 0.5, inf, nan, 0.5, inf, 1.0])
    weight_norms = torch.tensor([2.0, 0.0, 0.0, 0.0, 0.0, inf, 2.0, 1e-39])
    ratios = q.update_ratios(update_norms, weight_norms).tolist()
    assert ratios[:3] == [0.25, inf, inf]  # zero weights: +inf, moved or not
    assert all(math.isnan(r) for r in ratios[3:7])  # a non-finite update or weight: NaN
    assert ratios[7] == largest  # a finite ratio past float32: the largest float32, not +inf


def test_update_norms_of_large_cpu_layers_match_a_float64_reference():
    """Layers past the fused-distance row length (whole rows, a tail, exactly one row, non-finite
    weights) measure the same update norm as a float64 subtraction; the rounded-away counts too."""
    torch.manual_seed(5)
    row = q._DISTANCE_ROW
    params = [
        torch.randn(3 * row + 123) * 0.02,  # whole rows and a tail
        torch.randn(row),  # exactly one row
        torch.randn(64, 2 * row // 64),  # 2-d, whole rows only
        torch.randn(row + 7),  # its weights become non-finite below
        torch.randn(10),  # small: the foreach path
        torch.randn(row).bfloat16(),  # large, not float32: the foreach path
    ]
    grads = [torch.randn_like(p) for p in params]
    before = q.snapshot(params)
    reference = [p.detach().clone().double() for p in params]
    for p in params[:3] + params[4:5]:
        p.add_(torch.randn_like(p) * 1e-4)
    params[5][: row // 2].add_(1.0)  # bf16: the other half's updates are not applied at all
    params[3][5] = float("inf")
    ratios, counts = q.update_stats(params, grads, before)
    for i, (p, old) in enumerate(zip(params, reference, strict=True)):
        expected = ((old - p.double()).norm() / old.norm()).item()
        if not math.isfinite(expected):  # weights made infinite: NaN (an alarm); +inf means zero weights
            assert math.isnan(ratios[i].item())
        else:
            tolerance = 2e-5 if p.dtype == torch.float32 else 1e-2  # bf16: the difference is taken in bf16
            assert ratios[i].item() == pytest.approx(expected, rel=tolerance), i
    # fp32: stepped, none unchanged; bf16 counted element by element: the half left as it was
    assert counts.tolist() == [[0, g.numel()] for g in grads[:5]] + [[row - row // 2, row]]


def _reference_histogram(values):
    """One float32 layer's histogram row, computed from torch.frexp (no bit tricks)."""
    finite = torch.isfinite(values)
    zero = finite & (values.abs() < 2.0**-126)
    exponents = torch.frexp(values[finite & ~zero].abs()).exponent.clamp(q.EXPONENT_MIN, q.EXPONENT_MAX)
    row = torch.bincount(exponents.long() - q.EXPONENT_MIN, minlength=q.N_BINS + 2)
    row[q.ZERO_COLUMN] = int(zero.sum())
    row[q.NON_FINITE_COLUMN] = int((~finite).sum())
    return row


def _large_layer():
    torch.manual_seed(6)
    n = 2 * q._PIECE + 4099  # two whole pieces and a tail
    values = torch.randn(n) * 10.0 ** torch.randint(-30, 12, (n,)).float()
    values[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1e-40, -(2.0**60)])
    return values


def test_large_layers_counted_in_pieces_are_exact():
    big = _large_layer()
    odd = big[: q._PAIRED_FROM + 7]  # a piece counted in pairs of bytes, with one byte left over
    tensors = [big, torch.randn(10), None, big.bfloat16(), odd]
    counted = q.log2_histograms(tensors, torch.zeros(()))
    assert torch.equal(counted[0], _reference_histogram(big))
    assert torch.equal(counted[3], _reference_histogram(big.bfloat16().float()))
    assert torch.equal(counted[4], _reference_histogram(odd))
    assert counted[2].sum() == 0


def test_histograms_leave_torch_threading_alone():
    # A thread count set anywhere (even in a helper thread, even for a moment) is process state: a
    # reduction of the training loop's run with another count sums in another order.
    import threading

    threads = torch.get_num_threads()
    before = {t.ident for t in threading.enumerate()}
    q.log2_histograms([_large_layer()], torch.zeros(()))
    assert torch.get_num_threads() == threads
    assert {t.ident for t in threading.enumerate()} == before  # no thread of ours
    seen_in_new_thread = []
    thread = threading.Thread(target=lambda: seen_in_new_thread.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen_in_new_thread == [threads]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_forked_child_counts_its_histograms():
    big = _large_layer()
    expected = _reference_histogram(big)
    assert torch.equal(q.log2_histograms([big], torch.zeros(()))[0], expected)  # the parent's thread exists
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's was copied; nothing may wait on one
        torch.set_num_threads(1)  # as DataLoader workers do: OpenMP's thread pool does not survive a fork
        ok = torch.equal(q.log2_histograms([big], torch.zeros(()))[0], expected)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's histogram never finished")


def _watched_adam_steps(seed, steps, transport, seen, **options):
    """`steps` Adam steps on TinyNet watched with `options`; seen(watcher) after each step, collected."""
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    collected = []
    with _run(transport) as run:
        run.watch(model, optimizer, **options)
        watcher = run._watchers[-1]
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            collected.append(seen(watcher))
    return collected


def test_a_cpu_snapshot_is_kept_for_the_next_step_only_when_that_step_takes_one():
    transport = RecordingTransport()
    # every step during the dense start (steps 0-3), then every 2nd: snapshots at 0, 1, 2, 3, 4, 6
    kept = _watched_adam_steps(
        7,
        7,
        transport,
        lambda w: w._spent_snapshot is not None,
        update_ratio_every=2,
        dense_start_steps=4,
        layer_norms_every=0,
    )
    # kept after a step whose next step takes one too (0-3), freed after 4 (5 takes none) and 6
    assert kept == [True, True, True, True, False, False, False]
    assert sorted(transport.vectors("update/ratio")) == [0, 1, 2, 3, 4, 6]


def test_consecutive_snapshots_write_over_the_same_copies():
    copies = _watched_adam_steps(
        8,
        3,
        RecordingTransport(),
        lambda w: [id(c) for c in w._spent_snapshot.copies],
        update_ratio_every=1,
        layer_norms_every=0,
        histograms_every=0,
    )
    assert copies[0] == copies[1] == copies[2]  # no new model-sized allocation after the first


def test_a_float64_model_gets_its_norms_and_update_ratios(recwarn):
    torch.manual_seed(9)
    model = TinyNet().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, optimizer, layer_norms_every=1, param_norms_every=1, update_ratio_every=1)
        optimizer.zero_grad()
        x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.norm().item() for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        ratios = [
            ((p.detach() - b).norm() / b.norm()).item()
            for p, b in zip(model.parameters(), before, strict=True)
        ]
    assert not [w for w in recwarn.list if "gradwatch" in str(w.message)]  # no feature switched off
    assert transport.vectors("grad/norm")[0] == pytest.approx(grads, rel=1e-6)
    assert transport.vectors("update/ratio")[0] == pytest.approx(ratios, rel=1e-5)
    assert len(transport.vectors("param/norm")[0]) == len(grads)
