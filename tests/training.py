"""A tiny real training loop (fp16 autocast on CPU + GradScaler + AdamW + clipping) for the tests,
with a reference record of what gradwatch should observe, computed with plain autograd."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        self.blowup = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x)) * self.blowup
        return self.out(torch.relu(self.hidden(h)))


@dataclass
class Reference:
    """What happened, per optimizer step, seen by the test itself."""

    global_norms: list[float] = field(default_factory=list)  # unscaled, before clipping
    scales_after: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    non_finite_layers: list[list[str]] = field(default_factory=list)


def train(
    steps: int,
    run: Any = None,
    overflow_steps: tuple[int, ...] = (),
    precision: str = "fp16",
    seed: int = 0,
    log_loss: bool = True,
    reference: Reference | None = None,
    watch_options: dict[str, Any] | None = None,
    clip: str | None = "after_unscale",
    fused: bool = False,
    init_scale: float = 2.0**16,
) -> TinyNet:
    """Train TinyNet for `steps` optimizer steps; `overflow_steps` blow up activations to inf in fp16."""
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=20) if precision == "fp16" else None
    if run is not None:
        run.watch(model, optimizer, scaler=scaler, **(watch_options or {}))
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    for step in range(steps):
        x = torch.randn(8, 16, generator=generator)
        y = torch.randint(0, 4, (8,), generator=generator)
        model.blowup = 1e6 if step in overflow_steps else 1.0
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        if run is not None and log_loss:
            run.log({"loss": loss})
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip == "before_unscale":
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(optimizer)
            if reference is not None:
                reference.global_norms.append(_global_norm(model))
                reference.non_finite_layers.append(
                    [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
                )
                reference.skipped.append(
                    sum(v.item() for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
                    > 0
                )
            if clip == "after_unscale":
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if reference is not None:
                reference.scales_after.append(scaler.get_scale())
        else:
            loss.backward()
            if reference is not None:
                reference.global_norms.append(_global_norm(model))
                reference.skipped.append(False)
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        if reference is not None:
            reference.losses.append(loss.item())
    return model


def _global_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


class RecordingTransport:
    """A Transport that keeps what it is sent, for agent unit tests (no network)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []
        self.batches: list[dict[str, Any]] = []

    def create_run(self, run: dict[str, Any]) -> None:
        self.runs.append(run)

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None:
        self.batches.append(batch)

    def series(self, key: str) -> dict[int, Any]:
        points: dict[int, Any] = {}
        for batch in self.batches:
            for series in batch["scalars"]:
                if series["key"] == key:
                    points.update(zip(series["steps"], series["values"]))
        return dict(sorted(points.items()))

    def vectors(self, key: str) -> dict[int, list[Any]]:
        rows: dict[int, list[Any]] = {}
        for batch in self.batches:
            for vector in batch.get("vectors", []):
                if vector["key"] == key:
                    rows.update(zip(vector["steps"], vector["values"]))
        return dict(sorted(rows.items()))

    def histograms(self, key: str = "grad/hist") -> dict[int, dict[str, Any]]:
        return {h["step"]: h for b in self.batches for h in b.get("histograms", []) if h["key"] == key}

    def layers(self) -> list[str]:
        return next(b["layers"] for b in self.batches if "layers" in b)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for b in self.batches for e in b["events"] if e["kind"] == kind]
