"""What gradwatch records is what happened, however the loop is written: the unscaled gradient norms
before clipping on every step, with any clip or none, the post-clip norm whenever a clip rewrote the
gradients, nothing lost at flush steps, layers in the model's order."""

# As training scripts write it: the clip imported by name at the top, before gradwatch is imported.
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm  # isort: skip

import math

import httpx
import pytest
import torch
from torch import nn
from training import RecordingTransport, TinyNet, TrappedNet, spawn_ranks

import gradwatch

MAX_NORM = 0.05  # far below TinyNet's gradient norms: every clip cuts


def _hand_written_clip(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient)


def _two_part_clip(parameters, max_norm):
    parameters = list(parameters)
    total = get_total_norm([p.grad for p in parameters if p.grad is not None])
    clip_grads_with_norm_(parameters, max_norm, total)


CLIPS = {
    "by-name": lambda params, max_norm: clip_grad_norm_(params, max_norm),
    "two-part-by-name": _two_part_clip,
    "hand-written": _hand_written_clip,
    "none": None,
}


def _value(stored):
    """A stored value as a float ("NaN", "Infinity" travel as strings)."""
    return float(stored) if isinstance(stored, str) else stored


def _same(recorded, expected, rel=1e-5):
    recorded = _value(recorded)
    if math.isnan(expected):
        return math.isnan(recorded)
    if math.isinf(expected):
        return recorded == expected
    return recorded == pytest.approx(expected, rel=rel)


def _train(
    clip, precision, steps=8, accumulate=1, overflow_at=(), layer_norms_every=3, init_scale=2.0**12, **init
):
    """TinyNet trained `steps` optimizer steps in `precision` (fp16: autocast and a real GradScaler;
    bf16: autocast, no scaler; fp32; fp32-scaler: fp32 with a GradScaler from `init_scale`) with `clip`
    (a CLIPS entry) after unscale_; returns the transport and, per step, the reference: pre-clip
    per-layer and global norms, the post-clip global norm."""
    torch.manual_seed(0)
    model = TrappedNet()  # a step in overflow_at gives one layer (`trap`) an infinite gradient
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
        if precision in ("fp16", "fp32-scaler")
        else None
    )
    transport = RecordingTransport()
    reference = []
    generator = torch.Generator().manual_seed(0)
    with gradwatch.init(project="true-numbers", transport=transport, **init) as run:
        run.watch(model, optimizer, scaler=scaler, layer_norms_every=layer_norms_every, dense_start_steps=0)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            model.poison = math.inf if step in overflow_at else 0.0
            for _ in range(accumulate):
                x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
                with torch.autocast(
                    "cpu",
                    dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                    enabled=precision in ("fp16", "bf16"),
                ):
                    loss = nn.functional.cross_entropy(model(x).float(), y) / accumulate
                (scaler.scale(loss) if scaler else loss).backward()
            run.log({"loss": loss.detach()})  # mid-step, as many loops do
            if scaler is not None:
                scaler.unscale_(optimizer)
            layers = [p.grad.float().norm().item() for p in model.parameters()]
            if clip is not None:
                clip(model.parameters(), MAX_NORM)
            post = math.sqrt(sum(p.grad.float().norm().item() ** 2 for p in model.parameters()))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            reference.append(
                {"layers": layers, "global": math.sqrt(sum(n * n for n in layers)), "post": post}
            )
    return transport, reference, [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_pre_clip_norms_on_every_step_whatever_the_clip(clip, precision):
    overflow_at = (5,) if precision == "fp16" else ()
    # One packet (the clip's threshold is known from its second cut on, and given to the steps of
    # the packet that tells it: the first cut too).
    transport, reference, names = _train(CLIPS[clip], precision, overflow_at=overflow_at, flush_interval=600)
    assert transport.layers() == names
    global_norms = transport.series("grad/global_norm")
    assert sorted(global_norms) == list(range(8))
    per_layer = transport.vectors("grad/norm")
    assert sorted(per_layer) == sorted({0, 3, 6, *overflow_at})  # sampled, and every skipped step
    for step, expected in enumerate(reference):
        assert _same(global_norms[step], expected["global"]), (step, global_norms[step], expected)
        if step in per_layer:
            for recorded, layer in zip(per_layer[step], expected["layers"], strict=True):
                assert _same(recorded, layer), (step, per_layer[step], expected["layers"])
    if precision == "fp16":
        # The skipped step's layers are their real unscaled norms: the trapped one infinite, the
        # others finite and not 0 (a clip of an infinite total multiplies every gradient by 0).
        [skip] = transport.events("skip")
        assert skip["step"] == 5 and skip["data"]["non_finite_layers"] == ["trap"]
        finite = [_value(v) for v in per_layer[5] if math.isfinite(_value(v))]
        assert len(finite) == len(names) - 1 and all(v > 0 for v in finite)
    post_clip = transport.series("grad/global_norm_post_clip")
    if clip == "none":
        assert post_clip == {} and transport.series("grad/clip_max_norm") == {}
        return
    assert sorted(post_clip) == list(range(8))  # every step the clip rewrote, none lost mid-step
    for step, expected in enumerate(reference):
        assert _same(post_clip[step], expected["post"], rel=1e-4), (step, post_clip[step], expected)
    thresholds = transport.series("grad/clip_max_norm")
    assert {s: pytest.approx(v) for s, v in thresholds.items() if s not in overflow_at} == {
        s: pytest.approx(MAX_NORM, rel=1e-5) for s in range(8) if s not in overflow_at
    }


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accumulated_micro_batches_give_the_steps_summed_gradients(precision):
    transport, reference, _ = _train(CLIPS["by-name"], precision, steps=5, accumulate=3, layer_norms_every=1)
    global_norms, per_layer = transport.series("grad/global_norm"), transport.vectors("grad/norm")
    for step, expected in enumerate(reference):
        assert _same(global_norms[step], expected["global"])
        assert all(_same(r, e) for r, e in zip(per_layer[step], expected["layers"], strict=True))
    assert transport.series("amp/micro_batches") == dict.fromkeys(range(5), 3.0)


@pytest.mark.parametrize("init_scale", [2.0**66, 2.0**-80], ids=["huge-scale", "tiny-scale"])
def test_a_loss_scale_far_from_one_leaves_the_norms_true(init_scale):
    """A GradScaler that never meets an overflow (fp32 or bf16 gradients) doubles its scale without
    end: scaled by 2^66, gradients are finite but their float32 sum of squares is not (it read inf,
    and a non_finite alert fired on a healthy run); scaled by 2^-80 it underflows to 0. Measured
    unscaled, they are true."""
    transport, reference, _ = _train(
        CLIPS["by-name"], "fp32-scaler", steps=6, layer_norms_every=1, init_scale=init_scale
    )
    assert transport.events("skip") == []  # a healthy run: the scaler skipped nothing
    global_norms, per_layer = transport.series("grad/global_norm"), transport.vectors("grad/norm")
    assert sorted(global_norms) == sorted(per_layer) == list(range(6))
    for step, expected in enumerate(reference):
        assert math.isfinite(expected["global"]) and expected["global"] > 0
        assert _same(global_norms[step], expected["global"]), (step, global_norms[step], expected)
        assert all(_same(r, e) for r, e in zip(per_layer[step], expected["layers"], strict=True)), step
        assert _same(transport.series("grad/global_norm_post_clip")[step], expected["post"], rel=1e-4)


def test_a_clip_before_unscale_loses_its_first_step_only_and_says_why():
    """A misuse: clip_grad_norm_ of still-scaled gradients. Measured after unscale_, the first such
    step's norms would be post-clip: it records none (an event says why), and the steps after it are
    measured at the end of backward, scaled, before the clip."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    transport, reference = RecordingTransport(), []
    generator = torch.Generator().manual_seed(0)
    with gradwatch.init(project="true-numbers", transport=transport) as run:
        run.watch(model, optimizer, scaler=scaler, layer_norms_every=1, dense_start_steps=0)
        for _ in range(4):
            optimizer.zero_grad(set_to_none=True)
            x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            scale = scaler.get_scale()
            reference.append(
                math.sqrt(sum((p.grad.double() / scale).norm().item() ** 2 for p in model.parameters()))
            )
            clip_grad_norm_(model.parameters(), MAX_NORM)  # before unscale_: the misuse
            scaler.step(optimizer)
            scaler.update()
    assert transport.events("clip_before_unscale")
    [unmeasured] = transport.events("norms_unmeasured")
    assert unmeasured["step"] == 0 and "before scaler.unscale_" in unmeasured["data"]["reason"]
    global_norms = transport.series("grad/global_norm")
    assert sorted(global_norms) == [1, 2, 3]
    for step in (1, 2, 3):
        assert _same(global_norms[step], reference[step]), (step, global_norms[step], reference[step])


def test_no_point_is_lost_when_the_run_flushes_mid_step():
    # A flush due at every log (mid-step, after backward): the step's values travel together.
    transport, _, _ = _train(CLIPS["by-name"], "fp16", steps=12, overflow_at=(4, 9), flush_interval=1e-9)
    assert sorted(transport.series("grad/global_norm_post_clip")) == list(range(12))
    assert sorted(transport.series("grad/global_norm")) == list(range(12))
    skips = transport.events("skip")
    assert [e["step"] for e in skips] == [4, 9]
    for skip in skips:  # the scale before and after, and the layers: from one packet
        assert skip["data"]["scale_before"] is not None and skip["data"]["scale_after"] is not None
        assert skip["data"]["non_finite_layer_count"] >= 1


def test_layers_follow_the_model_not_the_optimizers_groups():
    torch.manual_seed(0)
    model = TinyNet()
    named = list(model.named_parameters())
    # nanoGPT's split: weights that decay, then biases that do not
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    transport = RecordingTransport()
    with gradwatch.init(project="order", transport=transport) as run:
        run.watch(model, optimizer, layer_norms_every=1)
        nn.functional.cross_entropy(model(torch.randn(4, 16)), torch.tensor([0, 1, 2, 3])).backward()
        reference = [p.grad.norm().item() for _, p in named]
        optimizer.step()
    assert transport.layers() == [n for n, _ in named]
    assert transport.vectors("grad/norm")[0] == pytest.approx(reference, rel=1e-6)


def test_gradients_assigned_by_hand_without_a_scaler_are_not_measured_and_say_why():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    transport = RecordingTransport()
    with gradwatch.init(project="by-hand", transport=transport) as run:
        run.watch(model, optimizer)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
    assert transport.series("grad/global_norm") == {}  # never a post-clip value under the pre-clip key
    [event] = transport.events("norms_unmeasured")
    assert event["step"] == 0 and "no backward pass" in event["data"]["reason"]


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_fsdp1_model_clip_on_two_gloo_ranks(sqlite_server, tmp_path, fp16):
    # FSDP1's own clip (model.clip_grad_norm_), a collective over the shards: each rank records its
    # shard's pre-clip norm, and the server's combination of them is the clip's own total.
    spool = tmp_path / "spool"
    spool.mkdir()
    run_id = f"fsdp1-clip-{fp16}"
    job = {
        "server": sqlite_server.url,
        "spool_dir": str(spool),
        "project": "fsdp1-clip",
        "parallel": "fsdp1",
        "steps": 4,
        "fp16": fp16,
        "clip": MAX_NORM,
        "clip_style": "fsdp",
        "watch": {"layer_norms_every": 1},
        "init": {"run_id": run_id},
    }
    results = spawn_ranks(2, job, tmp_path)
    totals = results[0]["clip_totals"]
    assert len(totals) == 4 and all(t > MAX_NORM for t in totals)
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as api:
        for key, expected in (
            ("grad/global_norm", totals),
            ("grad/global_norm_post_clip", [MAX_NORM] * 4),
        ):
            response = api.get(f"/api/v1/runs/{run_id}/ranks/series", params={"key": key})
            assert response.status_code == 200, response.text
            combined = response.json()
            assert combined["combine"] == "l2" and combined["steps"] == list(range(4)), (key, combined)
            for value, wanted in zip(combined["values"], expected, strict=True):
                assert value == pytest.approx(wanted, rel=1e-4), (key, combined["values"], expected)


class _Wide(nn.Module):
    """Layers of 2^18 weights: torch splits their reductions (norms, the clip, AdamW's sums) over
    its threads, so a thread count changed anywhere in the process would change their sums."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 512)
        self.hidden = nn.Linear(512, 512)
        self.out = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def _digest(watch: bool) -> str:
    import hashlib

    torch.manual_seed(0)
    model = _Wide()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    generator = torch.Generator().manual_seed(1)
    run = gradwatch.init(project="identical", transport=RecordingTransport()) if watch else None
    if run is not None:
        every_step = {"layer_norms_every": 1, "histograms_every": 1, "update_ratio_every": 1}
        run.watch(model, optimizer, scaler=scaler, param_norms_every=1, **every_step)
    for _ in range(10):
        optimizer.zero_grad(set_to_none=True)
        x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 8, (32,), generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if run is not None:
            run.log({"loss": loss})
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
    if run is not None:
        run.finish()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def test_twenty_watched_runs_with_everything_every_step_are_bit_identical_to_the_unwatched_one():
    threads = torch.get_num_threads()
    unwatched = _digest(watch=False)
    watched = [_digest(watch=True) for _ in range(20)]
    assert watched == [unwatched] * 20
    assert torch.get_num_threads() == threads


def _divide(parameters, by):
    for p in parameters:
        p.grad.div_(by)


def _norm(parameters):
    return math.sqrt(sum(p.grad.float().norm().item() ** 2 for p in parameters))


def _train_rewriting(after_backward, steps=10, micro_batches=4, scaler=False, flush_every_steps=None):
    """TinyNet in fp32, `micro_batches` backward passes of undivided losses per step, then
    `after_backward(parameters, step)`, which rewrites the gradients as a loop does and returns the
    norm a clip there would see. With `scaler`, a GradScaler scales the losses and after_backward
    gets `unscale` (scaler.unscale_ of the optimizer) to call. All in one packet, unless
    flush_every_steps. Returns the transport and those norms."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    generator = torch.Generator().manual_seed(0)
    transport, seen = RecordingTransport(), []
    flushes = {"flush_every_steps": flush_every_steps} if flush_every_steps else {}
    with gradwatch.init(project="true-numbers", transport=transport, flush_interval=600, **flushes) as run:
        run.watch(model, optimizer, scaler=grad_scaler, layer_norms_every=1, dense_start_steps=0)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(micro_batches):
                x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
                loss = nn.functional.cross_entropy(model(x), y)
                (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
            if grad_scaler is None:
                seen.append(after_backward(list(model.parameters()), step))
                optimizer.step()
                continue
            unscale = lambda: grad_scaler.unscale_(optimizer)  # noqa: E731
            seen.append(after_backward(list(model.parameters()), step, unscale=unscale))
            grad_scaler.step(optimizer)
            grad_scaler.update()
    return transport, seen


@pytest.mark.parametrize("then_clip", [False, True], ids=["divided", "divided-then-clipped"])
def test_gradients_divided_after_backward_are_no_clip_and_are_recorded_as_divided(then_clip):
    """Gradient accumulation averaged after backward (p.grad.div_(k)) rewrites the gradients as a clip
    would: the norms recorded are those the clip after it sees (its return value), and no clip
    threshold is made up from the division (it made clip_saturation fire on healthy runs)."""
    max_norm = 0.3  # TinyNet's divided norms are about 0.24-0.34 over these steps: the clip cuts some

    def divide_and_clip(parameters, _step):
        _divide(parameters, 4)
        if then_clip:
            return float(clip_grad_norm_(parameters, max_norm))
        return _norm(parameters)

    transport, seen = _train_rewriting(divide_and_clip)
    recorded = transport.series("grad/global_norm")
    assert recorded == {step: pytest.approx(norm, rel=1e-5) for step, norm in enumerate(seen)}
    per_layer = transport.vectors("grad/norm")
    assert all(_same(math.sqrt(sum(v * v for v in per_layer[s])), norm) for s, norm in enumerate(seen))
    [event] = transport.events("gradients_rescaled")
    assert event["data"]["factor"] == pytest.approx(0.25, rel=1e-5)
    thresholds = transport.series("grad/clip_max_norm")
    if then_clip:
        cuts = [step for step, norm in enumerate(seen) if norm > max_norm]
        assert 2 <= len(cuts) <= len(seen) - 2, seen  # the clip cut some steps and left others
        assert thresholds == {step: pytest.approx(max_norm, rel=1e-5) for step in range(len(seen))}
    else:
        assert thresholds == {}


@pytest.mark.parametrize("rewrite", ["clip_grad_value_", "divided-by-tokens"])
def test_a_rewrite_that_is_no_clip_by_the_global_norm_makes_up_no_threshold(rewrite):
    """clip_grad_value_ scales each layer its own way; a division by each step's token count scales
    them alike but by a factor of its own each step: neither has a max_norm, none is recorded."""
    tokens = [509, 498, 517, 488, 503, 511, 495, 507, 500, 492]

    def after_backward(parameters, step):
        seen = _norm(parameters)
        if rewrite == "clip_grad_value_":
            torch.nn.utils.clip_grad_value_(parameters, 0.01)
        else:
            _divide(parameters, tokens[step])
        return seen

    transport, seen = _train_rewriting(after_backward)
    assert transport.series("grad/clip_max_norm") == {}
    # the norms backward left: for a clip by value, the pre-clip norms
    assert transport.series("grad/global_norm") == {
        step: pytest.approx(n, rel=1e-5) for step, n in enumerate(seen)
    }
    assert transport.events("gradients_rescaled") == []
    assert len(transport.events("gradients_rewritten")) == (1 if rewrite == "clip_grad_value_" else 0)


@pytest.mark.parametrize("then_clip", [False, True], ids=["divided", "divided-then-clipped"])
def test_scaled_gradients_divided_before_unscale_are_no_misuse_and_are_recorded_as_divided(then_clip):
    """Under a GradScaler, p.grad.div_(k) of the still-scaled gradients before scaler.unscale_ is
    harmless (a division commutes with the unscale), unlike a clip there: no clip_before_unscale
    misuse is told, and the norms are those after the division. The first step's rewrite comes before
    any measurement: its norms are lost (said once); the later steps' are right."""
    max_norm = 0.3

    def divide_unscale_and_clip(parameters, _step, unscale):
        _divide(parameters, 4)
        unscale()
        if then_clip:
            return float(clip_grad_norm_(parameters, max_norm))
        return _norm(parameters)

    transport, seen = _train_rewriting(divide_unscale_and_clip, scaler=True)
    assert transport.events("clip_before_unscale") == []
    [unmeasured] = transport.events("norms_unmeasured")
    assert (
        unmeasured["step"] == 0
        and "division by the accumulation steps is not" in unmeasured["data"]["reason"]
    )
    recorded = transport.series("grad/global_norm")
    assert recorded == {step: pytest.approx(norm, rel=1e-5) for step, norm in enumerate(seen) if step > 0}
    thresholds = transport.series("grad/clip_max_norm")
    if then_clip:
        assert 2 <= len([n for n in seen if n > max_norm]) <= len(seen) - 2, seen
        assert thresholds == {step: pytest.approx(max_norm, rel=1e-5) for step in range(1, len(seen))}
    else:
        assert thresholds == {}


@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "grad-scaler-unscaled-by-its-step"])
def test_gradients_set_to_none_after_backward_are_left_out_not_taken_for_a_clip(scaler):
    """A layer left out of some steps by hand (its .grad set to None after backward): the norms are
    those the optimizer sees, without it; it is told as a layer without a gradient, and no clip (nor,
    under a GradScaler whose step unscales, a clip before unscale_)."""
    dropped_at = range(3, 7)

    def drop_the_head_on_some_steps(parameters, step, unscale=None):
        if step in dropped_at:
            parameters[-2].grad = None  # out.weight
            parameters[-1].grad = None  # out.bias
        kept = [p.grad for p in parameters if p.grad is not None]
        if unscale is not None:  # not called: scaler.step unscales; the reference is unscaled here
            return math.sqrt(sum((g.float().norm().item() / 2.0**10) ** 2 for g in kept))
        return math.sqrt(sum(g.float().norm().item() ** 2 for g in kept))

    transport, seen = _train_rewriting(drop_the_head_on_some_steps, scaler=scaler)
    assert transport.events("clip_before_unscale") == [] and transport.events("norms_unmeasured") == []
    assert transport.series("grad/global_norm") == {s: pytest.approx(n, rel=1e-5) for s, n in enumerate(seen)}
    per_layer = transport.vectors("grad/norm")
    assert all(per_layer[s][-2:] == [0.0, 0.0] for s in dropped_at)
    assert all(min(per_layer[s]) > 0 for s in range(10) if s not in dropped_at)
    assert [(e["step"], e["data"]["layers"]) for e in transport.events("no_gradient")] == [
        (3, ["out.weight", "out.bias"]),
        (7, []),
    ]
    assert transport.series("grad/global_norm_post_clip") == {}
    assert transport.events("gradients_rewritten") == [] and transport.series("grad/clip_max_norm") == {}


def test_a_division_by_the_micro_batches_is_known_from_its_first_step():
    """Each step flushed in a packet of its own (a slow real run): a factor of exactly 1/k on a step
    of k micro-batches is a division by them from the first step, not a clip."""

    def divide(parameters, _step):
        _divide(parameters, 4)
        return _norm(parameters)

    transport, seen = _train_rewriting(divide, flush_every_steps=1)
    assert transport.series("grad/global_norm") == {s: pytest.approx(n, rel=1e-5) for s, n in enumerate(seen)}
    [event] = transport.events("gradients_rescaled")
    assert event["step"] == 0 and transport.series("grad/clip_max_norm") == {}


def test_a_closure_passed_to_the_optimizer_step_is_measured_before_its_clip():
    """optimizer.step(closure) (Lightning's automatic optimization, LBFGS): the step's pre-hook runs
    before the closure's backward and clip; the clip is still seen (post-clip norm, max_norm)."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    transport, seen = RecordingTransport(), []

    def closure():
        optimizer.zero_grad()
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        seen.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        return loss

    with gradwatch.init(project="true-numbers", transport=transport, flush_interval=600) as run:
        run.watch(model, optimizer)
        for _ in range(6):
            optimizer.step(closure)
    assert transport.series("grad/global_norm") == {s: pytest.approx(n, rel=1e-5) for s, n in enumerate(seen)}
    assert transport.series("grad/global_norm_post_clip") == {
        s: pytest.approx(MAX_NORM, rel=1e-4) for s in range(6)
    }
    assert transport.series("grad/clip_max_norm") == {s: pytest.approx(MAX_NORM, rel=1e-5) for s in range(6)}
    assert transport.series("amp/micro_batches") == dict.fromkeys(range(6), 1.0)


@pytest.mark.parametrize("how", ["unfrozen", "add_param_group"])
def test_parameters_trainable_only_after_watch_count_in_the_global_norm(how):
    """Progressive unfreezing: a backbone frozen when run.watch() is called and unfrozen at step 4
    (the optimizer held it, or gets it then with add_param_group). grad/global_norm is still the norm
    the clip returns over every gradient; the per-layer values keep the layers watched from the start,
    and an event names the parameters that have none."""
    torch.manual_seed(0)
    model = TinyNet()
    backbone = [model.inp.weight, model.inp.bias]
    for p in backbone:
        p.requires_grad_(False)
    held = model.parameters() if how == "unfrozen" else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(held, lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    transport, seen = RecordingTransport(), []
    with gradwatch.init(project="true-numbers", transport=transport, flush_interval=600) as run:
        run.watch(model, optimizer, layer_norms_every=1, dense_start_steps=0)
        for step in range(8):
            if step == 4:
                for p in backbone:
                    p.requires_grad_(True)
                if how == "add_param_group":
                    optimizer.add_param_group({"params": backbone})
            optimizer.zero_grad(set_to_none=True)
            x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            nn.functional.cross_entropy(model(x), y).backward()
            seen.append(float(clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e6)))
            optimizer.step()
    assert transport.series("grad/global_norm") == {s: pytest.approx(n, rel=1e-5) for s, n in enumerate(seen)}
    assert transport.layers() == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    assert all(len(v) == 4 for v in transport.vectors("grad/norm").values())
    [event] = transport.events("params_unwatched")
    assert event["step"] == 4 and event["data"]["layers"] == ["inp.weight", "inp.bias"]
    assert transport.events("no_gradient") == []
