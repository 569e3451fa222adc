"""The guard (issue 38): a run's incidents reach the training thread at a step boundary, within a flush,
and the loop stops itself when asked; off, nothing changes. Real loops against a real uvicorn server."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import Guard, TrainingHalted

NAN_AT = 30  # the step whose batch holds a corrupt record (a NaN feature)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=generator)
    if step >= NAN_AT:
        x[3, 2] = float("nan")  # the record stays in the data: every later batch has one too
    return x, x.sum(dim=1, keepdim=True)


def _train(run: gradwatch.Run | None, steps: int, stop: bool = True) -> tuple[int, nn.Module]:
    """A plain loop written as the guard's docs say: `if run.should_stop: break`. Returns the number
    of optimizer steps taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if run is not None:
        run.watch(model, optimizer, guard=Guard(on_incident=seen.append) if stop else None)
    taken = 0
    for step in range(steps):
        if run is not None and run.should_stop:
            break
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if run is not None:
            run.log({"loss": loss})
        taken += 1
    return taken, model


seen: list[dict] = []


def _guarded_run(server) -> gradwatch.Run:
    return gradwatch.init(project="guard", server=server.url, flush_every_steps=5, flush_interval=0.05)


def _until_stopped(run: gradwatch.Run, guard: object) -> int | None:
    """The loop of the guard's docs on the NaN-from-step-30 data, until the guard stops it (a few hundred
    steps): the step the loop stopped before, None if it never did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model, optimizer, guard=guard)
    for step in range(20_000):
        if run.should_stop:
            return step
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.log({"loss": loss})
    return None


def test_a_critical_incident_stops_a_plain_loop_within_a_flush_and_the_callback_runs_in_the_training_thread(
    api_server,
):
    seen.clear()
    threads: list[str] = []

    at_steps: list[int] = []

    def on_incident(incident: dict) -> None:
        threads.append(threading.current_thread().name)
        at_steps.append(run.step)
        seen.append(incident)

    run = _guarded_run(api_server)
    stopped_at = _until_stopped(run, Guard(on_incident=on_incident))
    run.finish()
    assert stopped_at is not None, "the guard never stopped the loop"
    assert threads and set(threads) == {threading.main_thread().name}
    incident = run.guard.stopped_by
    assert incident["severity"] == "critical" and incident["first_step"] >= NAN_AT
    assert incident["last_healthy_step"] == incident["first_step"] - 1 >= NAN_AT - 1
    # The loss of step 30 is NaN: the server's answer to the batch holding it carries the incident, and
    # the loop learns it at the next step boundary (the callback and should_stop at the same one; the
    # loop checks before its next step). How many steps that is depends on how long the answer takes
    # against a step (here ~1 ms steps): bench/diagnosis.py measures it in steps on real runs.
    assert seen[0]["id"] == incident["id"] and at_steps[0] == stopped_at == run.guard.stopped_at_step
    assert stopped_at > NAN_AT


def test_run_log_raises_training_halted_when_asked_to(api_server):
    run = _guarded_run(api_server)
    with pytest.raises(TrainingHalted) as halted:
        _until_stopped(run, Guard(raise_on_stop=True))  # run.log() raises before the loop checks
    run.finish()
    assert halted.value.incident["severity"] == "critical"
    assert "last healthy step" in str(halted.value)
    run.log({"loss": 1.0})  # raised once: the loop's own handling (save, exit) is not interrupted again


def test_without_a_guard_nothing_stops_and_training_is_bit_identical(api_server):
    plain_steps, plain = _train(None, 60)
    run = gradwatch.init(project="guard", server=api_server.url, flush_every_steps=5, flush_interval=0.05)
    watched_steps, watched = _train(run, 60, stop=False)
    run.finish()
    assert plain_steps == watched_steps == 60 and not run.should_stop
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_guard_arguments_are_checked():
    assert Guard.from_argument(None) is None and Guard.from_argument(False) is None
    assert isinstance(Guard.from_argument(True), Guard)
    assert Guard.from_argument(print).on_incident is print
    with pytest.raises(ValueError, match="guard must be"):
        Guard.from_argument("yes")
    with pytest.raises(TypeError, match="stop_on"):
        Guard(stop_on="critical")
    with pytest.raises(ValueError, match="sync_every"):
        Guard(sync_every=0)


def test_incidents_are_handed_over_once_per_version_and_a_failing_callback_never_reaches_training():
    calls: list[dict] = []

    def callback(incident: dict) -> None:
        calls.append(incident)
        raise RuntimeError("the user's bug")

    guard = Guard(on_incident=callback, stop_on=("loss_divergence",))
    warning = {"id": 1, "status": "open", "severity": "warning", "cause_key": "clip_saturation"}
    guard.receive([warning])
    guard.at_step_boundary(5)
    guard.receive([warning])  # the same version again: not handed over again
    guard.at_step_boundary(6)
    assert len(calls) == 1 and not guard.should_stop
    guard.receive([{**warning, "id": 2, "cause_key": "loss_divergence", "severity": "critical"}])
    guard.at_step_boundary(7)
    assert len(calls) == 1  # the callback failed once: not called again (one warning)
    assert guard.should_stop and guard.stopped_at_step == 7 and guard.stopped_by["id"] == 2


def test_the_stop_is_an_event_of_the_run(api_server):
    """The guard's stop is recorded (event guard_stop: what stopped it, the last healthy step), so the
    run page's events show where and why training stopped."""
    import httpx

    run = _guarded_run(api_server)
    _until_stopped(run, True)
    run.finish()
    with httpx.Client(base_url=api_server.url) as client:
        events = client.get(f"/api/v1/runs/{run.id}/events").json()["data"]
    [stop] = [e for e in events if e["kind"] == "guard_stop"]
    assert stop["step"] == run.guard.stopped_at_step and stop["data"]["last_healthy_step"] == NAN_AT - 1
    assert stop["data"]["severity"] == "critical"
