"""The programs tests/agent/test_launchers.py launches: one tiny DDP job (gloo, CPU) under several
launchers, gradwatch on every rank as the README says, each rank writing what it saw to
OUT/rank{R}.json.

    python -m launch_jobs spawn JOB        torch.multiprocessing.start_processes, JOB["per_node"] ranks
    python -m launch_jobs worker JOB       one rank whose RANK / WORLD_SIZE / LOCAL_RANK come from the
                                           environment (torchrun, or `node` below)
    python -m launch_jobs node JOB         a node's launcher as DeepSpeed's is: a subprocess per local
                                           rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...
    python -m launch_jobs lightning JOB    Lightning Trainer(strategy="ddp_spawn") on CPU
    python -m launch_jobs accelerate JOB   Accelerate's notebook_launcher on CPU
    python -m launch_jobs accelerate-tracker JOB   the same, gradwatch as an Accelerate tracker
    python -m launch_jobs guard JOB        two DDP ranks whose loop stops when gradwatch's guard says so

JOB is JSON: server, spool_dir, project, out (folder), and optionally init_first (gradwatch.init()
before init_process_group / Accelerator()), host (this "node"'s hostname, patched into
socket.gethostname), node, per_node, world_size, init_method, steps.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def _init(job: dict[str, Any], **extra: Any) -> Any:
    import gradwatch

    return gradwatch.init(
        project=job["project"], server=job["server"], spool_dir=job["spool_dir"], flush_interval=0.1, **extra
    )


def _record(job: dict[str, Any], rank: int, run: Any) -> None:
    result = {
        "rank": rank,
        "run_id": run.id,
        "run_rank": run.rank,
        "host": socket.gethostname(),
        "sent": run.stats.sent,
        "dropped": run.stats.dropped,
        "spooled": run.stats.spooled,
    }
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))


def _patch_host(job: dict[str, Any]) -> None:
    if job.get("host"):  # a simulated node: gradwatch reads the host name from socket.gethostname()
        host = job["host"]
        socket.gethostname = lambda: host


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batch(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=generator), torch.randint(0, 2, (4,), generator=generator)


def rank_entry(local_rank: int, job: dict[str, Any]) -> None:
    """One rank: (gradwatch.init, if init_first) init_process_group, gradwatch.init, DDP, watch, train."""
    import torch
    import torch.distributed as dist
    from torch import nn

    _patch_host(job)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if job.get("from_env"):
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world_size = job.get("node", 0) * job["per_node"] + local_rank, job["world_size"]
    run = _init(job) if job.get("init_first") else None
    if run is not None:
        run.log({"before_group": 1.0})  # logged while the run id is not settled yet
    dist.init_process_group(
        "gloo", init_method=job.get("init_method", "env://"), rank=rank, world_size=world_size
    )
    try:
        if run is None:
            run = _init(job)
        model = nn.parallel.DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.watch(model, optimizer, layer_norms_every=1)
        for step in range(job.get("steps", 3)):
            x, y = _batch(step, rank)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            run.log({"loss": loss})
            loss.backward()
            optimizer.step()
        run.finish()
        _record(job, rank, run)
    finally:
        dist.destroy_process_group()


def spawn(job: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(rank_entry, args=(job,), nprocs=job["per_node"], start_method="spawn", join=True)


def worker(job: dict[str, Any]) -> None:
    rank_entry(int(os.environ.get("LOCAL_RANK", "0")), {**job, "from_env": True})


def node(job: dict[str, Any]) -> None:
    """A node's launcher (like DeepSpeed's launch.py): one subprocess per local rank, with the rank in
    its environment; exits with the first failing rank's code."""
    base = job["node"] * job["per_node"]
    children = []
    for local_rank in range(job["per_node"]):
        env = {
            **os.environ,
            "RANK": str(base + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(job["world_size"]),
            "LOCAL_SIZE": str(job["per_node"]),
            "CROSS_RANK": str(job["node"]),
            "CROSS_SIZE": str(job["world_size"] // job["per_node"]),
        }
        children.append(
            subprocess.Popen([sys.executable, "-m", "launch_jobs", "worker", json.dumps(job)], env=env)
        )
    codes = [child.wait() for child in children]
    sys.exit(next((code for code in codes if code), 0))


# -- Lightning (the module and callback live in lightning_job: ddp_spawn pickles them by name) -------


def lightning(job: dict[str, Any]) -> None:
    import lightning_job

    lightning_job.fit(job)


# -- Accelerate -----------------------------------------------------------------------------------


def accelerate_worker(job: dict[str, Any]) -> None:
    """One notebook_launcher process: gradwatch.init() first, then Accelerator() (which initialises the
    process group), prepare, watch, train."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    torch.set_num_threads(1)
    run = _init(job)
    run.log({"before_group": 1.0})
    accelerator = Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # The torch optimizer inside Accelerate's wrapper (as the Hugging Face callback does).
    run.watch(model, optimizer.optimizer, layer_norms_every=1)
    rank = accelerator.process_index
    for step in range(job.get("steps", 3)):
        x, y = _batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        run.log({"loss": loss})
        accelerator.backward(loss)
        optimizer.step()
    run.finish()
    _record(job, rank, run)


def accelerate(job: dict[str, Any]) -> None:
    from accelerate import notebook_launcher

    notebook_launcher(accelerate_worker, args=(job,), num_processes=2, use_port=str(job["port"]))


def accelerate_tracker_worker(job: dict[str, Any]) -> None:
    """One notebook_launcher process using gradwatch as an Accelerate tracker: log_with, init_trackers
    (the config), prepare, tracker.watch, accelerator.log, end_training."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    from gradwatch.integrations.accelerate import GradwatchTracker

    torch.set_num_threads(1)
    tracker = GradwatchTracker(
        project=job["project"], server=job["server"], spool_dir=job["spool_dir"], flush_interval=0.1
    )
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers(job["project"], config={"lr": 0.1, "world": accelerator.num_processes})
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tracker.watch(accelerator, model, optimizer, layer_norms_every=1)
    rank = accelerator.process_index
    for step in range(job.get("steps", 3)):
        x, y = _batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        accelerator.log({"loss": loss.item(), "note": "text is left out"}, step=step)
    run = tracker.tracker
    accelerator.end_training()
    _record(job, rank, run)


def accelerate_tracker(job: dict[str, Any]) -> None:
    from accelerate import notebook_launcher

    notebook_launcher(accelerate_tracker_worker, args=(job,), num_processes=2, use_port=str(job["port"]))


def guard_rank(local_rank: int, job: dict[str, Any]) -> None:
    """One DDP rank whose loop stops when the guard says so (issue 38): from step job["nan_at"] rank 0's
    batches hold a NaN record, so the loss turns NaN and a critical incident opens; each rank writes the
    step its loop stopped at to OUT/rank{R}.json."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import gradwatch

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=job["init_method"], rank=local_rank, world_size=2)
    try:
        run = _init(job, flush_every_steps=2)
        model = nn.parallel.DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.watch(model, optimizer, guard=gradwatch.Guard(sync_every=job["sync_every"]))
        stopped = None
        for step in range(job["steps"]):
            if run.should_stop:
                stopped = step
                break
            x, y = _batch(step, local_rank)
            if local_rank == 0 and step >= job["nan_at"]:
                x[0, 0] = float("nan")
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            run.log({"loss": loss})
            loss.backward()
            optimizer.step()
        incident = run.guard.stopped_by if run.guard is not None else None
        run.finish()
        Path(job["out"], f"rank{local_rank}.json").write_text(
            json.dumps({"stopped": stopped, "incident": (incident or {}).get("cause_key")})
        )
    finally:
        dist.destroy_process_group()


def guard(job: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(guard_rank, args=(job,), nprocs=2, start_method="spawn", join=True)


COMMANDS = {
    "guard": guard,
    "spawn": spawn,
    "worker": worker,
    "node": node,
    "lightning": lightning,
    "accelerate": accelerate,
    "accelerate-tracker": accelerate_tracker,
}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
