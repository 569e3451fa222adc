"""The harness every scenario trains in: the `Scenario` record of what it measured, the per-step
`_Trace`, the tiny models and tasks, the textbook fp16/fp32 steps and the gradwatch run that watches
them. Names with a leading underscore are for the scenarios of this package only."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# (name=..., config=..., run_id=None) -> gradwatch Run. A factory with a `make_guard` attribute (a
# callable returning a gradwatch.Guard) watches with that guard (bench/early_warning.py's stops).
RunFactory = Callable[..., Any]


class ScenarioError(AssertionError):
    """The mechanism did not produce what the scenario promises (e.g. another torch rounds otherwise)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioError(message)


@dataclass
class Scenario:
    """What one scenario did, measured by the scenario itself (no gradwatch involved)."""

    name: str
    pathology: str | None  # None: a healthy control
    onset_step: int | None  # first optimizer step where the problem is present
    # Where a divergence's precursors begin (the loss starting to climb, before onset_step's definition of
    # "diverged"): a warning from here on is an early detection, not a false one. None: the onset.
    precursors_from: int | None = None
    layers: list[str] = field(default_factory=list)  # affected parameter names, if the cause has any
    cause: str | None = None  # the incident cause_key a right diagnosis names, where pinned
    precision: str = "fp32"
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # unscaled, before clipping (inf/nan kept)
    lrs: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)  # loss scale after update; None: no scaler
    run_ids: list[str] = field(default_factory=list)  # gradwatch runs (one; two ids alike for a resume)
    agent_stats: list[dict[str, Any]] = field(default_factory=list)  # each run's SenderStats at finish
    facts: dict[str, Any] = field(default_factory=dict)  # the mechanism's own measurements
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def healthy(self) -> bool:
        return self.pathology is None


class _Trace:
    """Per-step records of one scenario; `step` is the next optimizer step's number."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    @property
    def step(self) -> int:
        return len(self.scenario.losses)

    def add(
        self,
        loss: torch.Tensor | float,
        grad_norm: float,
        lr: float,
        skipped: bool = False,
        scale: float | None = None,
    ) -> None:
        s = self.scenario
        s.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
        s.grad_norms.append(float(grad_norm))
        s.lrs.append(float(lr))
        s.skipped.append(bool(skipped))
        s.scales.append(scale)


# -- building blocks -----------------------------------------------------------------------------------


def _mlp(seed: int, sizes: tuple[int, ...] = (16, 32, 32, 4)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


class _Task:
    """A fixed random teacher labelling Gaussian inputs; batch(step) is the same for the same step."""

    def __init__(self, seed: int, features: int = 16, classes: int = 4, batch: int = 32) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(features, classes, generator=generator)
        self.seed, self.features, self.batch_size = seed, features, batch

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 64 + micro)
        x = torch.randn(self.batch_size, self.features, generator=generator)
        return x, (x @ self.teacher).argmax(dim=1)


def _grad_norm(parameters: Any, divide_by: float = 1.0) -> float:
    """L2 norm over every gradient (float64, on the host), divided by the loss scale if given."""
    grads = [p.grad.detach().double() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return (torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) / divide_by).item()


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


@contextlib.contextmanager
def _gradwatch(
    new_run: RunFactory | None,
    scenario: Scenario,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    run_id: str | None = None,
    start_step: int = 0,
    **config: Any,
) -> Iterator[Any]:
    """A watching run for the block (None without new_run), finished at its end."""
    if new_run is None:
        yield None
        return
    options = {"run_id": run_id} if run_id else {}
    run = new_run(name=scenario.name, config={"scenario": scenario.name, **config}, **options)
    run.step = start_step
    make_guard = getattr(new_run, "make_guard", None)
    run.watch(model, optimizer, scaler=scaler, guard=make_guard() if make_guard is not None else None)
    scenario.run_ids.append(run.id)
    try:
        yield run
    finally:
        run.finish()
        stats = run.stats
        scenario.agent_stats.append(
            {
                "sent": stats.sent,
                "queued": stats.queued,
                "spooled": stats.spooled,
                "dropped": stats.dropped,
                "last_error": stats.last_error,
            }
        )


def _log(run: Any, loss: torch.Tensor) -> None:
    if run is not None:
        run.log({"loss": loss.detach()})


def _fp16_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss: torch.Tensor,
    trace: _Trace,
    clip: float | None = 1.0,
) -> None:
    """The textbook fp16 step (scale, backward, unscale_, clip, step, update), recorded."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = _grad_norm(model.parameters())
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    lr, before = _lr(optimizer), scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    after = scaler.get_scale()
    trace.add(loss, norm, lr, skipped=after < before, scale=after)


def _fp32_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    trace: _Trace,
    clip: float | None = 1.0,
) -> None:
    loss.backward()
    norm = _grad_norm(model.parameters())
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    lr = _lr(optimizer)
    optimizer.step()
    trace.add(loss, norm, lr)


class _ChangeMeter:
    """Fraction of each parameter's elements an optimizer step left bit-identical."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.snapshot: list[torch.Tensor] = []

    def before(self) -> None:
        self.snapshot = [p.detach().clone() for _, p in self.params]

    def after(self) -> dict[str, float]:
        return {
            n: (p.detach() == old).double().mean().item()
            for (n, p), old in zip(self.params, self.snapshot, strict=True)
        }


def _first(flags: list[bool]) -> int | None:
    return next((i for i, flag in enumerate(flags) if flag), None)


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _timed(function: Callable[..., Scenario]) -> Callable[..., Scenario]:
    def timed(new_run: RunFactory | None = None, **options: Any) -> Scenario:
        started = time.perf_counter()
        scenario = function(new_run, **options)
        scenario.seconds = time.perf_counter() - started
        return scenario

    timed.__name__, timed.__doc__ = function.__name__, function.__doc__
    return timed
