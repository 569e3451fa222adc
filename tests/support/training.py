"""A tiny real training loop (fp16 autocast on CPU + GradScaler + AdamW + clipping) for the tests,
with a reference record of what gradwatch should observe, computed with plain autograd."""

from __future__ import annotations

import math
import threading
from collections import Counter
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
    max_norm: float = 1.0,
) -> TinyNet:
    """Train TinyNet for `steps` optimizer steps; `overflow_steps` blow up activations to inf in fp16."""
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=20)
        if precision == "fp16"
        else None
    )
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
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(optimizer)
            if reference is not None:
                reference.global_norms.append(_global_norm(model))
                reference.non_finite_layers.append(
                    [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
                )
                reference.skipped.append(
                    sum(
                        v.item()
                        for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
                    )
                    > 0
                )
            if clip == "after_unscale":
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
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
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
        if reference is not None:
            reference.losses.append(loss.item())
    return model


def _global_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def backward_and_step(loss: torch.Tensor, optimizer: Any, scaler: Any = None) -> None:
    """The loop's end of a step as written with and without a GradScaler: backward, then the step."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


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
                    points.update(zip(series["steps"], series["values"], strict=True))
        return dict(sorted(points.items()))

    def vectors(self, key: str) -> dict[int, list[Any]]:
        rows: dict[int, list[Any]] = {}
        for batch in self.batches:
            for vector in batch.get("vectors", []):
                if vector["key"] == key:
                    rows.update(zip(vector["steps"], vector["values"], strict=True))
        return dict(sorted(rows.items()))

    def histograms(self, key: str = "grad/hist") -> dict[int, dict[str, Any]]:
        return {h["step"]: h for b in self.batches for h in b.get("histograms", []) if h["key"] == key}

    def layers(self) -> list[str]:
        return next(b["layers"] for b in self.batches if "layers" in b)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for b in self.batches for e in b.get("events", []) if e["kind"] == kind]


# Tensor methods that copy a value to the host: on a GPU each one waits for the device (a sync).
HOST_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__")


class HostSyncs:
    """Counts the calls of HOST_SYNC_METHODS made by the thread that created it (not the agent's
    sender thread), under the current `phase`: set it to name what runs next. On CPU every op is
    synchronous, so the calls that would force a sync on a GPU are what can be counted.
    `monkeypatch` (pytest's) puts the methods back after the test."""

    def __init__(self, monkeypatch: Any, phase: str) -> None:
        self.phase = phase
        self.counts: Counter[str] = Counter()
        thread = threading.current_thread()
        for method in HOST_SYNC_METHODS:
            original = getattr(torch.Tensor, method)

            def counting(tensor: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if threading.current_thread() is thread:
                    self.counts[self.phase] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, method, counting)


# -- distributed training (gloo on CPU, one process per rank) ----------------------------------------


class _Poison(torch.autograd.Function):
    """Adds 0 to the forward pass; in backward gives its input the gradient `poison` (e.g. inf) and
    leaves every other gradient as it was."""

    @staticmethod
    def forward(ctx: Any, trap: torch.Tensor, poison: float) -> torch.Tensor:
        ctx.shape, ctx.poison = trap.shape, poison
        return trap.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_full(ctx.shape, ctx.poison), None


class TrappedNet(TinyNet):
    """TinyNet plus a parameter of its own whose gradient is `poison` when set: an inf that lands in
    one shard only (FSDP1 flattens the root's own parameters first: rank 0's shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.trap = nn.Parameter(torch.ones(4))
        self.poison = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + _Poison.apply(self.trap, self.poison)


def global_batch(
    step: int, world_size: int, per_rank: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch; rank r trains on rows [r * per_rank, (r + 1) * per_rank)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(per_rank * world_size, 16, generator=generator)
    y = torch.randint(0, 4, (per_rank * world_size,), generator=generator)
    return x, y


@dataclass
class StepRecord:
    """The unsharded reference of one step: norms of the (unscaled, pre-clip) gradients."""

    global_norm: float
    layer_norms: dict[str, float]
    param_norms: dict[str, float]
    histograms: dict[str, list[int]]  # log2 histogram row per layer (gradwatch's binning)


def reference_steps(steps: int, world_size: int, clip: float | None = 1.0) -> list[StepRecord]:
    """TinyNet trained in ONE process on the concatenated batches of all ranks (fp32, AdamW): what a
    sharded or replicated job's combined gradients must equal."""
    from gradwatch._quantities import log2_histograms

    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = []
    for step in range(steps):
        x, y = global_batch(step, world_size)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        names = [n for n, _ in model.named_parameters()]
        grads = [p.grad for p in model.parameters()]
        rows = log2_histograms(grads, grads[0]).tolist()
        records.append(
            StepRecord(
                global_norm=_global_norm(model),
                layer_norms={n: g.norm().item() for n, g in zip(names, grads, strict=True)},
                # parameter norms are taken after the step, as the agent takes them
                param_norms={},
                histograms=dict(zip(names, rows, strict=True)),
            )
        )
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        records[-1].param_norms.update({n: p.detach().norm().item() for n, p in model.named_parameters()})
    return records


def _init_process_group(rank: int, world_size: int, init_file: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _train_sharded_or_replicated(job: dict[str, Any], run: Any) -> nn.Module:
    """One rank's part of a job: FSDP2 (fully_shard per layer and root), FSDP1 or DDP around TinyNet
    (TrappedNet for FSDP1), AdamW, optionally fp16 autocast with a plain GradScaler and clipping."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model: nn.Module = TrappedNet() if job["parallel"] == "fsdp1" else TinyNet()
    inner = model
    if job["parallel"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.inp, model.hidden, model.out):
            fully_shard(layer)
        fully_shard(model)
    elif job["parallel"] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif job["parallel"] == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fp16 = job.get("fp16", False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20) if fp16 else None
    if run is not None:
        run.watch(model, optimizer, scaler=scaler, **job.get("watch", {}))
    clip_totals = job["clip_totals"] = []  # what the clip returned, per step (this training's)
    for step in range(job["steps"]):
        x, y = global_batch(step, world_size)
        x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        if isinstance(inner, TrappedNet):
            poisoned = rank == job.get("poison_rank", 0) and step in job.get("poison_steps", ())
            inner.poison = float("inf") if poisoned else 0.0
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if run is not None:
            run.log({"loss": loss})
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if job.get("clip"):
            if job.get("clip_style") == "fsdp":  # FSDP1's own: the shards' norms combined by a collective
                total = model.clip_grad_norm_(job["clip"])
            else:
                total = nn.utils.clip_grad_norm_(model.parameters(), job["clip"])
            clip_totals.append(total.item())
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return model


def _local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from gradwatch._distributed import dtensor_class, local_tensor

    dtensor = dtensor_class()
    return {n: local_tensor(p.detach(), dtensor).clone() for n, p in model.named_parameters()}


def rank_main(rank: int, world_size: int, init_file: str, job: dict[str, Any]) -> None:
    """The body of one rank (torch.multiprocessing or torchrun): trains `job` with gradwatch watching,
    and when job["compare_plain"] also without it, writing what it saw to job["out"]/rank{R}.json."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    import gradwatch

    if rank < 0:  # launched by torchrun: everything comes from the environment
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo")
    else:
        _init_process_group(rank, world_size, init_file)
    result: dict[str, Any] = {"rank": rank}
    try:
        plain = _train_sharded_or_replicated(job, None) if job.get("compare_plain") else None
        with gradwatch.init(
            project=job["project"],
            server=job["server"],
            spool_dir=job["spool_dir"],
            flush_interval=0.1,
            **job.get("init", {}),
        ) as run:
            watched = _train_sharded_or_replicated(job, run)
        result["run_id"] = run.id
        result["clip_totals"] = job.get("clip_totals", [])
        result["stats"] = {"sent": run.stats.sent, "dropped": run.stats.dropped, "spooled": run.stats.spooled}
        if plain is not None:
            a, b = _local_state(plain), _local_state(watched)
            result["bit_identical"] = all(torch.equal(a[n], b[n]) for n in a)
    finally:
        Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def spawn_ranks(
    world_size: int, job: dict[str, Any], tmp_path: Any, timeout: float = 180.0
) -> list[dict[str, Any]]:
    """Run rank_main in `world_size` fresh processes (spawn, gloo, a file rendezvous) and return what
    each rank wrote; a rank that fails or hangs past `timeout` s fails the caller."""
    import json
    import time

    import torch.multiprocessing as mp

    job = {**job, "out": str(tmp_path)}
    context = mp.start_processes(
        rank_main,
        args=(world_size, str(tmp_path / "rendezvous"), job),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def same_stored(a: float | None, b: float | None) -> bool:
    """Equal as the server stores values: exactly, NaN equal to NaN, None only to None."""
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b
