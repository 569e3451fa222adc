"""The agent's diagnostic signals, each checked against plain torch on a tiny CPU model: rounded-away
updates, zero fractions, dense start, the loss from scaler.scale(), batch ids on a bad loss, missing
gradients, a loaded scaler state and the clip threshold."""

import math
import threading
import warnings

import pytest
import torch
from torch import nn
from training import HostSyncs, RecordingTransport, Reference, TinyNet, backward_and_step, train

import gradwatch
from gradwatch import GradwatchWarning
from gradwatch import _quantities as q
from gradwatch._batches import MAX_BAD_BATCH_EVENTS, MAX_ID_CHARS, MAX_IDS_PER_STEP, MAX_STEPS
from gradwatch._watch import WatchOptions


def _run(transport, **options):
    return gradwatch.init(project="diagnosis", transport=transport, **options)


class PartlyUsed(nn.Module):
    """Two layers; `side` takes part in the forward pass only while `use_side` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(8, 4)
        self.side = nn.Linear(8, 4)
        self.use_side = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.main(x)
        return out + self.side(x) if self.use_side else out


@pytest.mark.parametrize("with_histograms", [False, True], ids=["counted", "from-histograms"])
def test_unchanged_counts_are_elementwise_for_low_precision_weights_and_whole_layer_for_fp32(
    with_histograms,
):
    torch.manual_seed(0)
    params = [
        torch.randn(64, dtype=torch.bfloat16),  # tiny updates, mostly rounded away
        torch.randn(32, dtype=torch.float16),  # normal updates: a few round away
        torch.randn(10),  # fp32, updated: nothing unchanged, whatever a few elements do
        torch.randn(6),  # fp32, left as it was (a learning rate of 0)
        torch.randn(3),  # no gradient
        torch.randn(5),  # an all-zero gradient
    ]
    grads = [torch.randn(64) * 1e-4, torch.randn(32), torch.randn(10), torch.randn(6), None, torch.zeros(5)]
    grads[0][:5] = 0.0
    grads[1][3] = float("nan")  # a non-finite gradient counts as non-zero
    grads[2][:4] = 0.0
    originals = [p.clone() for p in params]
    before = q.snapshot(params)
    with torch.no_grad():
        params[0].sub_(grads[0].to(torch.bfloat16) * 0.01)  # mostly below half an ulp: rounded away
        params[1].sub_(torch.nan_to_num(grads[1]).to(torch.float16) * 1e-3)
        params[2].sub_(grads[2] * 1e-9)  # below half an fp32 ulp for most elements: still "changed"
        params[2][-1] += 1.0
    # With the step's histograms, an fp32 layer's non-zero count is read from their zero column.
    histograms = q.log2_histograms(grads, params[0]) if with_histograms else None
    stats = q.update_stats(params, grads, before, histograms=histograms)
    counts = stats.unchanged_counts.tolist()
    for i in (0, 1):  # element by element
        stepped = grads[i] != 0
        assert counts[i] == [((originals[i] == params[i]) & stepped).sum().item(), stepped.sum().item()]
    assert counts[0][0] > 30, "a bf16 weight with tiny updates keeps most of its values"
    assert counts[2] == [0, 6]  # fp32: the layer changed, so no element counts as rounded away
    assert counts[3] == [6, 6]  # fp32 left exactly as it was
    assert counts[4] == counts[5] == [0, 0]
    ratios = stats.ratios.tolist()
    for i, (p, old) in enumerate(zip(params, originals, strict=True)):
        expected = ((old.double() - p.double()).norm() / old.double().norm()).item()
        assert ratios[i] == pytest.approx(expected, rel=1e-3, abs=1e-12), i
    assert q.rounded_away_fraction(0, 0) != q.rounded_away_fraction(0, 0)  # NaN
    assert q.rounded_away_fraction(3, 4) == 0.75


def _bf16_training(steps, run=None, lr=1e-3, options=None):
    """SGD on a bf16-stored PartlyUsed (side unused: no gradient); returns the model and the
    reference fraction of rounded-away updates per step and layer."""
    torch.manual_seed(0)
    model = PartlyUsed().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if run is not None:
        run.watch(model, optimizer, **(options or {}))
    names = [n for n, _ in model.named_parameters()]
    reference = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator).to(torch.bfloat16)
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        optimizer.step()
        row = []
        for n, p in model.named_parameters():
            g = grads[n]
            stepped = 0 if g is None else (g != 0).sum().item()
            unchanged = 0 if g is None else ((before[n] == p.detach()) & (g != 0)).sum().item()
            row.append(unchanged / stepped if stepped else math.nan)
        reference.append(row)
    return model, names, reference


def test_rounded_away_fraction_matches_the_reference_for_bf16_weights():
    transport = RecordingTransport()
    with _run(transport) as run:
        model, names, reference = _bf16_training(6, run, options={"update_ratio_every": 1})
    plain, _, _ = _bf16_training(6)
    for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), "observing rounded-away updates changed training"
    got = transport.vectors("update/rounded_away_frac")
    assert list(got) == list(range(6))
    assert transport.layers() == names
    for step, row in got.items():
        for name, value, expected in zip(names, row, reference[step], strict=True):
            if math.isnan(expected):
                assert value == "NaN", (step, name)  # side.* never had a gradient
            else:
                assert value == pytest.approx(expected, abs=1e-12), (step, name)
    assert any(v > 0.5 for row in got.values() for v in row[:2]), "bf16 with lr 1e-3 rounds updates away"
    assert len(transport.vectors("update/ratio")) == 6  # the ratio still uses the same snapshot


def test_rounded_away_fraction_is_zero_for_fp32_weights_and_sampled_like_the_update_ratio():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(12, run=run, precision="bf16", watch_options={"update_ratio_every": 5, "dense_start_steps": 0})
    got = transport.vectors("update/rounded_away_frac")
    assert list(got) == list(transport.vectors("update/ratio")) == [0, 5, 10]
    assert all(v == 0.0 for row in got.values() for v in row)


@pytest.mark.parametrize("fused", [False, True])
def test_rounded_away_fraction_is_dropped_on_skipped_steps(fused):
    transport = RecordingTransport()
    with _run(transport) as run:
        train(8, run=run, overflow_steps=(3,), fused=fused, watch_options={"update_ratio_every": 1})
    got = transport.vectors("update/rounded_away_frac")
    assert 3 not in got and {0, 1, 2, 4} <= set(got)


# -- 2. zero fraction ---------------------------------------------------------------------------------


def test_zero_fraction_matches_the_gradients_with_and_without_a_scaler():
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        torch.manual_seed(0)
        model = PartlyUsed()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        transport = RecordingTransport()
        with _run(transport) as run:
            run.watch(model, optimizer, scaler=scaler, histograms_every=1)
            x = torch.randn(4, 8)
            x[:, :3] = 0.0  # the weights' first three columns get zero gradients
            loss = model(x).square().mean()
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            grads = [p.grad for p in model.parameters()]
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        [row] = transport.vectors("grad/zero_frac").values()
        for value, grad in zip(row, grads, strict=True):
            if grad is None:
                assert value == "NaN"
            else:
                assert value == pytest.approx((grad.abs() < 2.0**-126).sum().item() / grad.numel())
        assert row[0] == pytest.approx(3 / 8)  # main.weight
        assert (transport.vectors("grad/underflow_frac") != {}) == (scaler is not None)


def test_zero_fraction_from_a_histogram_row():
    row = q.log2_histograms([torch.tensor([0.0, 0.0, 1.0, float("nan")])], torch.zeros(())).tolist()[0]
    assert q.zero_fraction(row) == 0.5
    assert math.isnan(q.zero_fraction([0] * (q.N_BINS + 2)))


# -- 3. dense start -----------------------------------------------------------------------------------


def test_due_is_denser_during_the_first_steps():
    options = WatchOptions(dense_start_steps=50)
    assert [s for s in range(130) if options.due(20, s)] == [
        0,
        4,
        8,
        12,
        16,
        20,
        24,
        28,
        32,
        36,
        40,
        44,
        48,
        60,
        80,
        100,
        120,
    ]
    assert [s for s in range(10) if options.due(3, s)] == list(range(10))  # 3 // 5 = 0 → every step
    assert not any(options.due(0, s) for s in range(10))
    assert [s for s in range(250) if WatchOptions(dense_start_steps=0).due(100, s)] == [0, 100, 200]
    assert [s for s in range(250) if WatchOptions().due(100, s)] == [
        0,
        20,
        40,
        60,
        80,
        100,
        120,
        140,
        160,
        180,
        200,
    ]
    with pytest.raises(ValueError, match="dense_start_steps must be a whole number of steps >= 0"):
        WatchOptions(dense_start_steps=-1)


def test_dense_start_samples_every_quantity_in_a_real_loop():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(45, run=run, watch_options={"dense_start_steps": 25})
    skipped = {s for s, v in transport.series("amp/skipped").items() if v}  # localised: norms taken too
    assert sorted(set(transport.vectors("grad/norm")) - skipped) == [0, 4, 8, 12, 16, 20, 24, 40]
    assert list(transport.vectors("param/norm")) == [0, 20]
    assert list(transport.vectors("update/ratio")) == [0, 20]
    assert list(transport.histograms()) == [0, 20]
    steady = RecordingTransport()
    with _run(steady) as run:
        train(45, run=run, watch_options={"dense_start_steps": 0})
    skipped = {s for s, v in steady.series("amp/skipped").items() if v}
    assert sorted(set(steady.vectors("grad/norm")) - skipped) == [0, 20, 40]
    assert list(steady.vectors("param/norm")) == [0]


# -- 4. the loss from scaler.scale() -------------------------------------------------------------------


def test_amp_loss_is_the_mean_of_the_step_micro_batch_losses():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    transport = RecordingTransport()
    expected = []
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler)
        for step in range(3):
            losses = []
            for micro in range(step + 1):
                x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                if step == 2 and micro == 1:
                    loss = loss * float("nan")
                losses.append(loss.item())
                scaler.scale(loss).backward()
            scaler.scale([torch.ones(()), torch.ones(())])  # a list of tensors: left alone
            scaler.scale(outputs=torch.ones(2))  # more than one element: not a loss
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            expected.append(sum(losses) / len(losses))
    got = transport.series("amp/loss")
    assert transport.series("amp/micro_batches") == {0: 1.0, 1: 2.0, 2: 3.0}
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert got[1] == pytest.approx(expected[1], rel=1e-6)
    assert got[2] == "NaN"


def test_amp_loss_is_recorded_in_the_standard_loop_and_the_wrapper_is_removed():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(4, run=run, log_loss=False)
    assert list(transport.series("amp/loss")) == [0, 1, 2, 3]
    assert set(transport.series("amp/micro_batches").values()) == {1.0}
    scaler = torch.amp.GradScaler("cpu")
    model = nn.Linear(2, 2)
    run = _run(RecordingTransport()).watch(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    assert {"scale", "load_state_dict"} <= set(vars(scaler))
    run.finish()
    assert not {"scale", "load_state_dict", "step", "update", "unscale_"} & set(vars(scaler))


# -- 5. batch ids -------------------------------------------------------------------------------------


def test_a_nan_loss_names_the_batch_it_came_from():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler)
        for step in range(8):
            indices = torch.arange(step * 4, step * 4 + 4)
            run.log_batch([f"shard-{step}:0", *indices.tolist()])
            model.blowup = 1e6 if step in (2, 5) else 1.0  # fp16 activations overflow: the loss is not finite
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randn(4, 16)).float(), indices % 4)
            run.log({"loss": loss})
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    losses = transport.series("loss")
    assert [s for s, v in losses.items() if isinstance(v, str)] == [2, 5]
    events = transport.events("bad_batch")
    assert [e["step"] for e in events] == [2, 5]  # one per step, though amp/loss is not finite either
    for event in events:
        step = event["step"]
        assert event["data"] == {
            "key": "loss",
            "value": losses[step],
            "ids": [f"shard-{step}:0", *range(step * 4, step * 4 + 4)],
            "ids_logged": True,
        }


def test_bad_batch_from_amp_loss_and_without_a_watcher():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(8, run=run, overflow_steps=(5,), log_loss=False)  # no run.log: amp/loss only
    amp_loss = transport.series("amp/loss")
    [event] = transport.events("bad_batch")
    assert event["step"] == 5 and event["data"]["key"] == "amp/loss"
    assert event["data"]["value"] == amp_loss[5] and event["data"]["value"] in ("NaN", "Infinity")
    assert event["data"]["ids"] == [] and event["data"]["ids_logged"] is False

    unwatched = RecordingTransport()
    with _run(unwatched) as run:
        run.log_batch(7, step=3)
        run.log({"loss": float("-inf")}, step=3)
        run.log({"loss": 1.0}, step=4)
    [event] = unwatched.events("bad_batch")
    assert event == {
        "step": 3,
        "kind": "bad_batch",
        "data": {"key": "loss", "value": "-Infinity", "ids": [7], "ids_logged": True},
    }


@pytest.mark.parametrize("with_scaler", [False, True], ids=["fp32", "grad-scaler"])
def test_only_the_batch_that_put_nan_into_the_weights_is_named_not_those_after_it(with_scaler):
    """Without a scaler, the NaN batch's update puts NaN into the weights and every loss after it is
    NaN whatever its batch: only the culprit is named. With one, each bad batch's step is skipped (the
    weights stay finite), so two bad batches in a row are both named."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    bad = (3, 4, 7) if with_scaler else (3,)
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler)
        for step in range(10):
            run.log_batch(f"batch-{step}")
            x = torch.randn(4, 16)
            if step in bad:
                x[0, 0] = float("nan")  # one corrupt sample
            loss = nn.functional.cross_entropy(model(x), torch.arange(4) % 4)
            run.log({"loss": loss})
            optimizer.zero_grad()
            backward_and_step(loss, optimizer, scaler)
    non_finite = [s for s, v in transport.series("loss").items() if isinstance(v, str)]
    assert non_finite == (list(bad) if with_scaler else list(range(3, 10)))  # the weights are NaN from step 4
    events = transport.events("bad_batch")
    assert [(e["step"], e["data"]["ids"]) for e in events] == [(s, [f"batch-{s}"]) for s in bad]


def test_batch_ids_are_bounded():
    transport = RecordingTransport()
    with _run(transport, flush_every_steps=10**9, flush_interval=3600) as run:
        for step in range(MAX_STEPS + 3):
            run.log_batch(step, step=step)
        assert run._batches.ids_at(0) is None  # left the ring: 1024 newer steps
        assert run._batches.ids_at(1) is None
        assert run._batches.ids_at(3) == [3]
        for step in range(400):  # a bad batch every other step, each one a culprit
            run.log({"loss": float("nan") if step % 2 == 0 else 1.0}, step=step)
    events = transport.events("bad_batch")
    assert len(events) == MAX_BAD_BATCH_EVENTS
    assert [e["step"] for e in events] == list(range(0, 2 * MAX_BAD_BATCH_EVENTS, 2))
    assert events[2]["data"]["ids"] == [4]
    assert events[0]["data"] == {"key": "loss", "value": "NaN", "ids": [], "ids_logged": False}

    ring = gradwatch.Run("p", transport=RecordingTransport())
    ring.log_batch(range(100), step=0)
    ring.log_batch("x", step=0)  # the step already holds 64: dropped
    ring.log_batch(["y" * 1000, "\x00z"], step=1)
    ring.log_batch(torch.arange(3), step=2)
    assert ring._batches.ids_at(0) == list(range(MAX_IDS_PER_STEP))
    assert ring._batches.ids_at(1) == ["y" * MAX_ID_CHARS, "\x00z"]
    assert ring._batches.ids_at(2) == [0, 1, 2]
    ring.log({"loss": float("nan")}, step=1)
    ring.finish()


def test_bad_ids_are_ignored_with_a_warning():
    run = _run(RecordingTransport())
    for bad, match in (
        (1.5, "got float"),
        ([1, 2.5], "got float 2.5"),
        (b"ab", "got bytes"),
        ([True], "bool"),
        (torch.zeros(2), "integers"),
        (torch.zeros(2, dtype=torch.long, device="meta"), "on meta"),
    ):
        with pytest.warns(GradwatchWarning, match=match):
            run.log_batch(bad)
    assert run._batches.ids_at(0) is None
    run.finish()


def test_log_batch_is_thread_safe():
    run = _run(RecordingTransport())

    def log(offset):
        for step in range(MAX_STEPS):
            run.log_batch([offset, f"{offset}:{step}"], step=step)

    threads = [threading.Thread(target=log, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for step in range(MAX_STEPS):
        ids = run._batches.ids_at(step)
        assert sorted(i for i in ids if isinstance(i, int)) == [0, 1, 2, 3]
        assert sorted(i for i in ids if isinstance(i, str)) == [f"{t}:{step}" for t in range(4)]
    run.finish()


# -- 6. missing gradients -----------------------------------------------------------------------------


def test_no_gradient_events_follow_the_set_of_layers_without_gradients():
    torch.manual_seed(0)
    model = PartlyUsed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    transport = RecordingTransport()
    use_side = [False, False, True, True, False, False]
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler, layer_norms_every=1)
        missing_reference = []
        for use in use_side:
            model.use_side = use
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            missing_reference.append([n for n, p in model.named_parameters() if p.grad is None])
            scaler.step(optimizer)
            scaler.update()
    events = transport.events("no_gradient")
    assert [(e["step"], e["data"]) for e in events] == [
        (0, {"layers": ["side.weight", "side.bias"], "count": 2}),
        (2, {"layers": [], "count": 0}),
        (4, {"layers": ["side.weight", "side.bias"], "count": 2}),
    ]
    assert missing_reference[0] == ["side.weight", "side.bias"] and missing_reference[2] == []
    assert transport.vectors("grad/norm")[0][2:] == [0.0, 0.0]  # the norms say 0, the event says why


def test_a_fully_used_model_has_no_no_gradient_event():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(10, run=run, watch_options={"layer_norms_every": 1})
    assert transport.events("no_gradient") == []


# -- 7. scaler state loaded ---------------------------------------------------------------------------


def test_loading_a_scaler_state_is_an_event_with_its_scale():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    saved = torch.amp.GradScaler("cpu", init_scale=512.0)
    saved.scale(torch.ones(()))  # creates its scale tensor
    transport = RecordingTransport()
    with _run(transport) as run:
        run.watch(model, optimizer, scaler=scaler)
        for _ in range(2):
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        scaler.load_state_dict(saved.state_dict())
        state = saved.state_dict()
        state["scale"] = torch.tensor(64.0)
        scaler.load_state_dict(state_dict=state)
    events = transport.events("scaler_state_loaded")
    assert [(e["step"], e["data"]) for e in events] == [(2, {"scale": 512.0}), (2, {})]
    assert scaler.get_scale() == 64.0


# -- 8. clip threshold --------------------------------------------------------------------------------


def test_clip_max_norm_is_sent_on_clipped_steps_only():
    transport = RecordingTransport()
    reference = Reference()
    with _run(transport) as run:
        train(6, run=run, reference=reference, max_norm=0.5)
    post_clip = transport.series("grad/global_norm_post_clip")
    assert sorted(post_clip) == list(range(6))  # the clip rewrote the gradients on every step
    for step, norm in enumerate(reference.global_norms):
        assert post_clip[step] == pytest.approx(min(norm, 0.5), rel=1e-4)
    # max_norm is known from the second step the clip cut (norm above 0.5) and carried after it; the
    # first cut gets it too, whether it travelled in the same packet or alone before (a slow run
    # flushes every step): grad/clip_max_norm starts at the first cut in every run
    first_cut = next(step for step, norm in enumerate(reference.global_norms) if norm > 0.5)
    thresholds = transport.series("grad/clip_max_norm")
    assert set(thresholds) == set(range(first_cut, 6)) and set(thresholds.values()) == {0.5}
    step_by_step = RecordingTransport()
    with _run(step_by_step, flush_every_steps=1) as run:
        train(6, run=run, max_norm=0.5)
    assert step_by_step.series("grad/clip_max_norm") == thresholds
    unclipped = RecordingTransport()
    with _run(unclipped) as run:
        train(4, run=run, clip=None)
    assert unclipped.series("grad/clip_max_norm") == {}
    assert unclipped.series("grad/global_norm_post_clip") == {}
    before_unscale = RecordingTransport()
    with _run(before_unscale) as run:
        train(3, run=run, clip="before_unscale")
    assert before_unscale.events("clip_before_unscale")
    assert before_unscale.series("grad/clip_max_norm") == {}


def test_everything_on_at_once_keeps_training_bit_identical_and_quiet():
    options = {"layer_norms_every": 1, "histograms_every": 1, "update_ratio_every": 1, "param_norms_every": 1}
    plain = train(12, overflow_steps=(4,))
    transport = RecordingTransport()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _run(transport) as run:
            watched = train(12, run=run, overflow_steps=(4,), watch_options=options)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert len(transport.vectors("grad/zero_frac")) == 12
    assert len(transport.vectors("update/rounded_away_frac")) == 11  # step 4 was skipped


def test_no_host_sync_with_every_new_signal_on_every_step(monkeypatch):
    """As test_agent's sync test, with every sampled quantity on every step (CPU ops are synchronous,
    so count the calls that would force a sync on a GPU)."""
    options = {"layer_norms_every": 1, "histograms_every": 1, "update_ratio_every": 1, "param_norms_every": 1}
    syncs = HostSyncs(monkeypatch, phase="without")
    train(8, overflow_steps=(3,))
    syncs.phase = "with"
    run = _run(RecordingTransport())
    train(8, run=run, overflow_steps=(3,), watch_options=options)
    syncs.phase = "finish"
    run.finish()
    assert syncs.counts["without"] > 0
    assert syncs.counts["with"] == syncs.counts["without"]


def test_micro_batches_count_backward_passes_without_a_scaler():
    """Gradient accumulation is seen in any loop (fp32/bf16, no GradScaler): backward passes per step."""
    transport = RecordingTransport()
    run = gradwatch.init(project="t", transport=transport, flush_interval=0.05)
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer)
    for _ in range(3):
        for _ in range(4):  # four micro-batches per optimizer step
            nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    run.finish()
    assert transport.series("amp/micro_batches") == {0: 4.0, 1: 4.0, 2: 4.0}


class _UnusedHead(nn.Module):
    """A model whose last layer in model order gets no gradient (an auxiliary or value head this loss
    does not use), and whose body may be checkpointed (reentrant: a nested backward per pass)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.unused_head = nn.Linear(16, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            x = x.requires_grad_()
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True)
        return self.body(x)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "reentrant-checkpoint"])
@pytest.mark.parametrize("with_scaler", [False, True], ids=["no-scaler", "grad-scaler"])
def test_micro_batches_are_counted_when_the_last_layer_gets_no_gradient(with_scaler, checkpointed):
    """The passes per step do not hang on one layer: a last layer left without a gradient (an unused
    head) still gives amp/micro_batches, and a reentrant checkpoint's nested backward is no extra pass."""
    transport = RecordingTransport()
    run = gradwatch.init(project="t", transport=transport, flush_interval=0.05)
    torch.manual_seed(0)
    model = _UnusedHead(checkpointed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if with_scaler else None
    run.watch(model, optimizer, scaler=scaler)
    for accumulation in (1, 3, 2):
        for _ in range(accumulation):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    run.finish()
    assert model.unused_head.weight.grad is None
    assert transport.series("amp/micro_batches") == {0: 1.0, 1: 3.0, 2: 2.0}


def test_passes_whose_gradients_were_thrown_away_are_no_micro_batches():
    """A GAN loop: the discriminator's backward also reaches the generator (no detach), then the
    generator's gradients are set to None before its own backward. The watched generator's step
    took one pass, not two; two backward passes after one zero_grad are two micro-batches."""
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(8, 16), nn.Linear(16, 1)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    transport = RecordingTransport()
    with _run(transport, flush_interval=0.05) as run:
        run.watch(generator, opt_g)
        for step in range(4):
            opt_d.zero_grad()
            discriminator(generator(torch.randn(4, 8))).mean().backward()  # reaches the generator too
            opt_d.step()
            opt_g.zero_grad()
            for _ in range(1 if step < 2 else 2):  # then two micro-batches per generator step
                (-discriminator(generator(torch.randn(4, 8)))).mean().backward()
            opt_g.step()
    assert transport.series("amp/micro_batches") == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}


class _SharedBlock(nn.Module):
    """One block applied three times (ALBERT-like weight sharing), each call under a reentrant
    checkpoint: the block's weights accumulate a gradient in each of three nested backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        for _ in range(3):
            x = torch.utils.checkpoint.checkpoint(lambda h: torch.tanh(self.block(h)), x, use_reentrant=True)
        return self.head(x)


def test_a_weight_shared_by_checkpointed_blocks_counts_one_pass_not_one_per_use():
    transport = RecordingTransport()
    torch.manual_seed(0)
    model = _SharedBlock()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with _run(transport, flush_interval=0.05) as run:
        run.watch(model, optimizer)
        for accumulation in (1, 2, 1):
            for _ in range(accumulation):
                nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert transport.series("amp/micro_batches") == {0: 1.0, 1: 2.0, 2: 1.0}
