"""How often gradwatch reads the gradients per optimizer step (issue 40: the floor is once). One read a
step, however the loop clips and however many micro-batches it accumulates, outside the per-layer
sampling steps (there the clipped gradients are read again: their per-layer norms, and the check of the
clip's factor). Real loops, torch's norm functions counted."""

from __future__ import annotations

import math
import time

import pytest
import torch
from norm_reads import CountNormReads
from torch import nn
from training import RecordingTransport

import gradwatch

EVERY = 10  # layer_norms_every: the sampling steps, where the post-clip norms are read fully


def _wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


def _reads_per_step(tmp_path, micro_batches: int, scaler_on: bool, fused: bool) -> dict[int, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_on)
    run = gradwatch.init(project="reads", mode="offline", spool_dir=str(tmp_path), flush_every_steps=2)
    run.watch(model, optimizer, scaler, dense_start_steps=0, layer_norms_every=EVERY)
    total = sum(p.numel() for p in model.parameters())
    reads = {}
    for step in range(30):
        if step == 5:  # the clip's factor is trusted once its first check (step 0) reaches the sender
            _wait_for(lambda: run._watchers[0]._clip_factor.state != "unverified")
        counting = CountNormReads()
        with counting:
            optimizer.zero_grad(set_to_none=True)
            for micro in range(micro_batches):
                generator = torch.Generator().manual_seed(step * 10 + micro)
                x = torch.randn(32, 16, generator=generator)
                loss = nn.functional.cross_entropy(model(x), torch.randint(4, (32,), generator=generator))
                scaler.scale(loss / micro_batches).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # cuts on every step
            scaler.step(optimizer)
            scaler.update()
        if step >= 5:  # past the steps that learn the passes per step and the clip's factor
            reads[step] = counting.elements["gradwatch"] / total
        assert counting.elements["loop"] >= total  # the clip's own read (at least), counted apart
    run.finish()
    return reads


@pytest.mark.parametrize(
    ("micro_batches", "scaler_on", "fused"),
    [
        (1, True, False),
        (1, False, False),
        (4, True, False),
        (4, False, False),
        (1, True, True),
        (4, True, True),
    ],
    ids=[
        "scaler",
        "no-scaler",
        "scaler-4-micro",
        "no-scaler-4-micro",
        "scaler-fused",
        "scaler-fused-4-micro",
    ],
)
def test_gradwatch_reads_the_gradients_once_per_step_outside_the_sampling_steps(
    tmp_path, micro_batches, scaler_on, fused
):
    """A fused optimizer under a GradScaler has no unscale_ of its own to wait for: its gradients are
    measured at the end of backward, at the pass the step's last is expected to be."""
    reads = _reads_per_step(tmp_path, micro_batches, scaler_on, fused)
    # + a few numbers: the global norm is taken over the per-layer norms (4 layers here)
    plain = [r for step, r in reads.items() if step % EVERY]
    sampled = [r for step, r in reads.items() if step % EVERY == 0]
    assert len(plain) == 23 and all(1.0 <= r <= 1.01 for r in plain), reads  # exact values: truth tests
    assert len(sampled) == 2 and all(r <= 2.01 for r in sampled), reads


def test_a_step_with_fewer_micro_batches_is_lost_once_and_measured_the_next_times():
    """An epoch's last accumulation window is often partial (2 micro-batches where the others have 4),
    and the loop clips after it. gradwatch measures a step once, at the pass it expects to be the last:
    the first short step ends before that pass, its gradients clipped: its norms are lost (said once,
    why); from then on a pass of that count is measured too, so the next short step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    transport = RecordingTransport()
    passes = [4, 4, 4, 2, 4, 4, 2, 4, 4]
    expected = {}
    with gradwatch.init(project="reads", transport=transport, flush_interval=600) as run:
        run.watch(model, optimizer, dense_start_steps=0, layer_norms_every=EVERY)
        for step, micro_batches in enumerate(passes):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(micro_batches):
                generator = torch.Generator().manual_seed(step * 10 + micro)
                x = torch.randn(32, 16, generator=generator)
                loss = nn.functional.cross_entropy(model(x), torch.randint(4, (32,), generator=generator))
                (loss / micro_batches).backward()
            expected[step] = math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters()))
            post = nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert float(post) == pytest.approx(expected[step], rel=1e-5)
            optimizer.step()
    recorded = transport.series("grad/global_norm")
    assert sorted(recorded) == [s for s in range(len(passes)) if s != 3]  # the first short step only
    for step, norm in recorded.items():
        assert norm == pytest.approx(expected[step], rel=1e-5), step
    assert transport.series("amp/micro_batches") == {s: float(n) for s, n in enumerate(passes)}
    [unmeasured] = transport.events("norms_unmeasured")
    assert unmeasured["step"] == 3 and "fewer backward passes" in unmeasured["data"]["reason"]
    post_clip = transport.series("grad/global_norm_post_clip")
    assert sorted(post_clip) == sorted(recorded)  # with its pre-clip norm: the lost step has neither
    assert all(v == pytest.approx(0.05, rel=1e-4) for v in post_clip.values())
