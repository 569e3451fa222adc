"""The guard of an offline run (issue 38): with no server to judge it, the agent decides alone what it
can (a NaN loss, non-finite gradients that reached the weights, a skip storm past calibration) and stops
the loop at the next step boundary; a healthy fp16 run's sawtooth stops nothing. Real loops, real
GradScaler, mode="offline" (nothing listens anywhere)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import Guard, TrainingHalted


@pytest.fixture
def offline_run(tmp_path):
    def make() -> gradwatch.Run:
        return gradwatch.init(project="offline-guard", mode="offline", spool_dir=str(tmp_path))

    return make


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, nan_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=generator)
    if nan_from is not None and step >= nan_from:
        x[3, 2] = float("nan")
    return x, x.sum(dim=1, keepdim=True)


def test_a_nan_loss_stops_an_offline_fp32_loop_at_the_next_step_boundary(offline_run):
    run = offline_run()
    seen: list[tuple[dict, str]] = []
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer, guard=Guard(lambda i: seen.append((i, threading.current_thread().name))))
    stopped_before = None
    for step in range(200):
        if run.should_stop:
            stopped_before = step
            break
        x, y = _batch(step, nan_from=40)
        loss = nn.functional.mse_loss(model(x), y)
        run.log({"loss": loss})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    run.finish()
    # Step 40's loss is NaN: the loop learns it at the end of step 40 and does not start step 41.
    assert stopped_before == 41
    kinds = {incident["cause_key"]: incident for incident, _ in seen}
    assert set(kinds) == {"loss_non_finite", "non_finite_applied"}, kinds
    loss_incident = kinds["loss_non_finite"]
    assert loss_incident["first_step"] == 40 and loss_incident["last_healthy_step"] == 39
    assert loss_incident["severity"] == "critical" and loss_incident["id"] < 0
    assert "NaN" in loss_incident["title"] and "offline" in loss_incident["title"]
    assert {thread for _, thread in seen} == {threading.current_thread().name}
    assert run.guard is not None and run.guard.stopped_at_step == 41


def test_non_finite_gradients_applied_without_a_scaler_stop_the_loop_even_with_a_finite_loss(offline_run):
    run = offline_run()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer, guard=Guard(raise_on_stop=True))
    with pytest.raises(TrainingHalted) as halted:
        for step in range(200):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if step == 25:  # a bad kernel writes an inf into one gradient; the loss was finite
                model[0].weight.grad[0, 0] = float("inf")
            optimizer.step()
            run.log({"loss": loss.item()})
    run.finish()
    incident = halted.value.incident
    assert incident["cause_key"] == "non_finite_applied" and incident["first_step"] == 25
    assert incident["last_healthy_step"] == 24 and incident["stopped_at_step"] == 26


def _fp16_loop(run: gradwatch.Run, steps: int, overflow_from: int | None) -> int | None:
    """fp16 autocast on the CPU with a real GradScaler (growth_interval 10: a sawtooth every ~10 steps).
    From `overflow_from`, every other step's gradients hold an inf (a layer that overflows at any scale).
    Returns the step the loop stopped before, None when it never stopped."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    run.watch(model, optimizer, scaler, guard=True)
    for step in range(steps):
        if run.should_stop:
            return step
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if overflow_from is not None and step >= overflow_from and step % 2 == 0:
            model[2].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        run.log({"loss": loss.item()})
    return None


def test_a_skip_storm_after_calibration_stops_an_offline_fp16_loop(offline_run):
    run = offline_run()
    stopped = _fp16_loop(run, 300, overflow_from=100)
    run.finish()
    assert run.guard is not None and run.guard.stopped_by is not None
    incident = run.guard.stopped_by
    # Skips at 100, 102, 104...; the first may be the sawtooth's probe (the scale grew since the last
    # skip), which does not count; the fourth counted skip opens the storm and the loop stops after it.
    assert incident["cause_key"] == "skip_storm" and incident["first_step"] in (100, 102)
    first, last = incident["suspect_steps"]
    assert first == incident["first_step"] and last == first + 6
    assert incident["last_healthy_step"] == first - 1 and stopped == last + 1


def test_a_healthy_fp16_sawtooth_and_a_clean_fp32_run_stop_nothing_offline(offline_run):
    run = offline_run()
    assert _fp16_loop(run, 300, overflow_from=None) is None
    assert run.guard is not None and not run.guard.should_stop
    run.finish()


def test_an_online_run_is_not_judged_by_the_agent(api_server):
    run = gradwatch.init(project="online-guard", server=api_server.url)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer, guard=True)
    assert run.guard is not None and run.guard.offline is None  # the server's rules judge it
    run.finish()


def test_an_offline_run_without_a_guard_reads_nothing_and_stops_nothing(offline_run):
    run = offline_run()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guard: not even a warning about the NaN
        for step in range(45):
            x, y = _batch(step, nan_from=40)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run.log({"loss": loss})
    assert not run.should_stop
    run.finish()
