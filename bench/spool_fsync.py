"""Spool fsync: what durability costs. The spool fsyncs a file it writes at most once a second
(Spool.sync_due, called by the sender's collector thread), so a power cut loses about a second of
spooled data at most. Measured here side by side, in one process, against no fsync at all and
against an fsync after every append.

    .venv/bin/python bench/spool_fsync.py            # --rounds 5 --block-s 3 --keys 100 --steps-per-flush 100
    .venv/bin/python bench/spool_fsync.py --quick    # a smoke test (~15 s)

Part 1, spool appends: what the collector does while the server is down or the run is offline, as
fast as the disk takes it. Each append is one sealed batch of a fast fp32 loop's flush (--keys
scalars x --steps-per-flush steps, fp32 values), written with Spool.add(persist=True) followed by
Spool.sync_due(), exactly the collector's calls, for --block-s seconds per block:
    off      fsync_interval=None: no fsync until close (the spool before this change)
    off again the same, a second time: the noise floor of the comparison
    1/s      fsync_interval=1.0: the default
    every    fsync_interval=0: an fsync after every append (the reference the once-a-second cap avoids)
Blocks are interleaved over --rounds rounds, the order rotated each round. Reported: appends/s and
MB/s (totals over rounds), fsyncs, their mean latency, the share of the writing thread's time spent
in fsync (the direct cost, steadier than the throughput ratio on a shared machine), and appends/s
against `off`.

Part 2, a real fp32 training loop: an MLP (--width, 4 layers) trained with AdamW in fp32 on the CPU,
gradwatch offline (run.watch + run.log of the loss and --keys extra scalars every step; the sender
seals and appends a batch to the spool file every second), blocks of --train-s seconds with the
spool's fsync off / off again / 1/s, interleaved. Reported: the training thread's wall time per step and the
process's CPU time per step (all threads: gradwatch's collector does the writing and the fsync),
each against `off`.

Prints the CPU (torch.backends.cpu.get_cpu_capability()), torch and Python versions, and the file
system of the spool folder (--dir, default a temporary folder in GRADWATCH_HOME, where spools live:
a tmpfs would make fsync free and the figures meaningless). Asserts nothing; exits 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradwatch
from gradwatch._spool import Spool, gradwatch_home
from gradwatch._wire import batch_points

RUN = {"id": "bench-fsync", "project": "bench", "name": "fsync", "config": {}, "metadata": {}}
CONFIGS = {"off": None, "off again": None, "1/s": 1.0, "every": 0.0}  # "off again": the noise floor


def file_system(path: Path) -> str:
    """The mount's type and device for `path` (from /proc/mounts; "?" elsewhere)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, fs_type = line.split()[:3]
                if str(path.resolve()).startswith(mount_point) and len(mount_point) > len(best):
                    best, kind = mount_point, f"{fs_type} on {device} (mounted at {mount_point})"
    except OSError:
        pass
    return kind


def flush_batch(seq: int, keys: int, steps: int, first_step: int) -> dict[str, Any]:
    """One sealed batch as the sender builds it: `keys` scalar series over `steps` steps (fp32 values)."""
    values = torch.randn(keys, steps, dtype=torch.float32).tolist()
    return {
        "rank": 0,
        "seq": seq,
        "scalars": [
            {"key": f"k{k:03d}", "steps": list(range(first_step, first_step + steps)), "values": values[k]}
            for k in range(keys)
        ],
        "events": [],
    }


def spool_block(
    folder: Path, interval: float | None, seconds: float, batches: list[dict[str, Any]]
) -> dict[str, float]:
    path = folder / f"block-{time.monotonic_ns()}.jsonl"
    spool = Spool(path, RUN, fsync_interval=interval, max_bytes=1 << 40)
    appends = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = dict(batches[appends % len(batches)], seq=appends)
        spool.add(batch, batch_points(batch), persist=True)
        spool.sync_due()
        appends += 1
    elapsed = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return {
        "seconds": elapsed,
        "appends": appends,
        "bytes": size,
        "fsyncs": spool.fsyncs,
        "fsync_s": spool.fsync_seconds,
    }


def part_spool(args: argparse.Namespace, folder: Path) -> None:
    batches = [flush_batch(0, args.keys, args.steps_per_flush, i * args.steps_per_flush) for i in range(4)]
    totals = {
        name: {"seconds": 0.0, "appends": 0, "bytes": 0, "fsyncs": 0, "fsync_s": 0.0} for name in CONFIGS
    }
    names = list(CONFIGS)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            result = spool_block(folder, CONFIGS[name], args.block_s, batches)
            for key, value in result.items():
                totals[name][key] += value
    points = args.keys * args.steps_per_flush
    print(
        f"\n### Part 1: spool appends ({args.keys} keys x {args.steps_per_flush} steps: "
        f"{points:,} points each)\n"
    )
    print("| fsync | appends/s | MB/s | fsyncs | mean fsync | time in fsync | appends/s vs off |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = totals["off"]["appends"] / totals["off"]["seconds"]
    for name in names:
        t = totals[name]
        rate = t["appends"] / t["seconds"]
        latency = f"{t['fsync_s'] / t['fsyncs'] * 1000:.2f} ms" if t["fsyncs"] else "–"
        mb_s = t["bytes"] / t["seconds"] / 1e6
        share = t["fsync_s"] / t["seconds"]
        print(
            f"| {name} | {rate:,.0f} | {mb_s:,.1f} | {t['fsyncs']:,} | {latency} | {share:.1%} "
            f"| {rate / base:.3f} |"
        )


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def part_training(args: argparse.Namespace, folder: Path) -> None:
    torch.manual_seed(0)
    model = MLP(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    run = gradwatch.init(project="bench", name="fsync", mode="offline", spool_dir=folder)
    run.watch(model, optimizer)
    spool = run._sender.spool  # the bench switches the run's own spool between the configurations
    names = ["off", "off again", "1/s"]
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpu = dict.fromkeys(names, 0.0)
    fsyncs = dict.fromkeys(names, 0)
    fsync_s = dict.fromkeys(names, 0.0)

    def steps_for(seconds: float, record: list[float] | None) -> None:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run.log({"loss": loss, **{f"k{k:03d}": float(k) for k in range(args.keys)}})
            if record is not None:
                record.append(time.perf_counter() - t0)

    steps_for(2.0, None)  # warm-up
    for round_index in range(args.rounds):
        for name in names[round_index % 3 :] + names[: round_index % 3]:
            spool.fsync_interval = CONFIGS[name]
            before_fsyncs, before_s = spool.fsyncs, spool.fsync_seconds
            cpu_before = time.process_time()
            steps_for(args.train_s, walls[name])
            time.sleep(1.2)  # the block's last seal and fsync land in its own accounting
            cpu[name] += time.process_time() - cpu_before
            fsyncs[name] += spool.fsyncs - before_fsyncs
            fsync_s[name] += spool.fsync_seconds - before_s
    run.finish()
    print(
        f"\n### Part 2: fp32 training loop, gradwatch offline ({args.width}-wide 4-layer MLP, "
        f"batch {args.batch}, loss + {args.keys} scalars logged a step)\n"
    )
    print(
        "| fsync | steps | median step | mean step | CPU per step | fsyncs | mean fsync "
        "| mean step vs off | CPU vs off |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_mean = statistics.fmean(walls["off"])
    base_cpu = cpu["off"] / len(walls["off"])
    for name in names:
        w = walls[name]
        per_step_cpu = cpu[name] / len(w)
        latency = f"{fsync_s[name] / fsyncs[name] * 1000:.2f} ms" if fsyncs[name] else "–"
        median, mean = statistics.median(w) * 1e3, statistics.fmean(w) * 1e3
        print(
            f"| {name} | {len(w):,} | {median:.3f} ms | {mean:.3f} ms | {per_step_cpu * 1e3:.3f} ms "
            f"| {fsyncs[name]} | {latency} | {mean / 1e3 / base_mean:.3f} | {per_step_cpu / base_cpu:.3f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-s", type=float, default=3.0, help="seconds per spool-append block")
    parser.add_argument("--train-s", type=float, default=4.0, help="seconds per training block")
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--steps-per-flush", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None, help="spool folder (default: in GRADWATCH_HOME)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 s blocks: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.block_s, args.train_s = 2, 1.0, 1.5
    torch.set_num_threads(1)
    home = gradwatch_home()
    home.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-spool-fsync-", dir=args.dir or home))
    print("## Spool fsync\n")
    print(f"    {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
        f"torch.backends.cpu.get_cpu_capability() = {torch.backends.cpu.get_cpu_capability()}; "
        f"torch {torch.__version__}, Python {platform.python_version()}, torch threads 1; fp32"
    )
    print(f"Spool folder: {folder} -- {file_system(folder)}")
    try:
        part_spool(args, folder)
        part_training(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
