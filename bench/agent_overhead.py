"""Agent overhead: what gradwatch costs a real fp16 training step, next to wandb.watch and TensorBoard.

    .venv/bin/python bench/agent_overhead.py            # the full benchmark (~11 min on the shared 2-CPU VM)
    .venv/bin/python bench/agent_overhead.py --quick    # tiny model, few rounds: a smoke test

A small GPT-style decoder (torch.nn, ~14M parameters by default) is trained on CPU with AdamW
(fused by default, --optimizer), in fp32 by default or under torch.autocast("cpu") in fp16 / bf16
(--precision), with a real torch.amp.GradScaler("cpu"), scaler.unscale_ and clip_grad_norm_(1.0) on
synthetic tokens, under these configurations:

    base       no monitoring (the baseline)
    base2      no monitoring, a second, identical copy: the noise floor of the comparison itself
    gw         gradwatch defaults (init + run.watch(model, optimizer, scaler=scaler) + run.log loss),
               online, sending to a gradwatch server in its own process on 127.0.0.1
    gw_all     gradwatch with everything every step (layer_norms_every=1, histograms_every=1,
               update_ratio_every=1), online as above
    gw_off     gradwatch defaults, mode="offline" (a local JSON-lines file, no server)
    gw_all_off gradwatch everything every step, offline
    gw_guard   gradwatch defaults with watch(..., guard=True), online (the guard's cost)
    wandb      wandb.watch(model, log="all", log_freq=1) + wandb.log({"loss": loss.item()}), offline
    tb         TensorBoard: add_histogram of every gradient and parameter every step + add_scalar loss

Fairness (--isolation toggle, the default). ONE process trains ONE model/optimizer/scaler on a fixed
cycle of synthetic batches; every configuration's monitoring is set up once (gradwatch runs, the wandb
run, the SummaryWriter) but ATTACHED only for that configuration's own blocks: run.watch /
wandb.watch before the block, the watcher removed / wandb.unwatch after it (this also removes
gradwatch's process-wide clip_grad_norm_ patch, installed only while a watcher is registered), so no
hook leaks into another configuration's timing, and the configurations without gradwatch call the
unpatched torch function. All configurations time the very same tensors: no difference in memory
layout or allocator state between model copies enters the comparison (with one process and model per
configuration, --isolation process, two identical baselines differed by ~10% on this machine). A
gradwatch run keeps its step counter across its blocks, so its every-10 / every-100-step schedules
play out as in one long run; its data buffered at a block's end is flushed in its next block.

The allocator (--allocator kept, the default). glibc malloc adapts its thresholds as memory is freed
and gives memory back to the OS by its own rules, so the baseline's own per-step allocations (the
gradients, set to None and made again every step; activations) re-faulted anywhere from 300 to 6,300
pages a step from one run to the next, moving its system time by ~15 ms a step. The benchmark fixes
the thresholds for the training process (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 TiB:
freed memory is kept for reuse, as PyTorch's CPU tuning guides advise with jemalloc or tcmalloc), the
same for every configuration; --allocator default measures under glibc's own. The table reports each
configuration's minor page faults per step (this process, not wandb-core).

Timed blocks are INTERLEAVED: each round runs every configuration for --steps-per-round steps, in an
order rotated every round to cancel drift. After each block the process sleeps --settle seconds so
that asynchronous work a configuration started (gradwatch's sender threads, the server's ingest,
wandb's writer process) is done, and counted to it, before the next configuration starts.

Measured per block:
- wall: time of each training step on the training thread (what a user sees as step time);
- cpu (training side): CPU seconds of the training process (all its threads: gradwatch's sender
  threads, TensorBoard's writer) and its child processes (wandb-core; not the gradwatch server) over
  the block and its settle pause, per step, with OMP_WAIT_POLICY=PASSIVE so idle OpenMP threads do not
  spin: the monitoring's machine cost, much less sensitive to other jobs than wall time;
- server cpu: the gradwatch server process's CPU over the same interval (online configurations), shown
  apart because a real server usually runs elsewhere; here it shares the 2 CPUs, so the wall times of
  the online configurations include its competition.
Overhead = (total over rounds of a configuration) / (total of the baseline) - 1, with a 95% bootstrap
interval over rounds (rounds resampled in pairs: a round of a configuration with the same round of the
baseline). Periodic work (every 10 / 100 steps) is therefore amortised as in a long run.

Afterwards, one extra instrumented worker process per gradwatch schedule (defaults: --profile-steps
steps, enough to include the every-100-step work; everything-every-step: a tenth of that) runs with
gradwatch's own functions wrapped in timers (inclusive wall time per call), to show where its cost goes.

Prints a Markdown report on stdout and exits 0; it asserts no floor (BENCHMARKS.md says whether they hold).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import multiprocessing as mp
import os
import platform
import random
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from _common import server_command

REPO = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, str] = {
    "base": "A  no monitoring (baseline)",
    "base2": "A' no monitoring, 2nd copy (noise floor)",
    "gw": "B  gradwatch defaults, online",
    "gw_all": "C  gradwatch everything every step, online",
    "wandb": "D  wandb.watch(log='all', log_freq=1), offline",
    "tb": "E  TensorBoard histograms every step",
    "gw_off": "B' gradwatch defaults, offline",
    "gw_all_off": "C' gradwatch everything every step, offline",
    "gw_guard": "B+ gradwatch defaults with a guard, online",
}
GRADWATCH_CONFIGS = {"gw", "gw_all", "gw_off", "gw_all_off", "gw_guard"}
ONLINE_CONFIGS = {"gw", "gw_all", "gw_guard"}
EVERYTHING = {"layer_norms_every": 1, "histograms_every": 1, "update_ratio_every": 1}


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    context: int
    width: int
    layers: int
    heads: int
    batch: int


MODEL_SIZES = {
    # ~14M parameters (GPT-2-like, tied embeddings), 2 x 64 tokens per step: ~0.3 s per step on 2 vCPUs
    "small": ModelSize(vocab=8192, context=64, width=384, layers=6, heads=6, batch=2),
    # ~0.1M parameters: for --quick
    "tiny": ModelSize(vocab=512, context=32, width=64, layers=2, heads=2, batch=4),
    # ~29M parameters
    "medium": ModelSize(vocab=8192, context=64, width=512, layers=8, heads=8, batch=2),
}


# -- the model and the training step ----------------------------------------------------------------


def build_model(size: ModelSize) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln_1 = nn.LayerNorm(width)
            self.attn = nn.Linear(width, 3 * width)
            self.attn_proj = nn.Linear(width, width)
            self.ln_2 = nn.LayerNorm(width)
            self.mlp_fc = nn.Linear(width, 4 * width)
            self.mlp_proj = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self, s: ModelSize) -> None:
            super().__init__()
            self.wte = nn.Embedding(s.vocab, s.width)
            self.wpe = nn.Embedding(s.context, s.width)
            self.blocks = nn.ModuleList([Block(s.width, s.heads) for _ in range(s.layers)])
            self.ln_f = nn.LayerNorm(s.width)
            self.lm_head = nn.Linear(s.width, s.vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT(size)


class Monitor:
    """One configuration's monitoring: set up once, attached to the model for its own blocks only."""

    def __init__(self, config: str, workdir: Path, server_url: str | None, server_mode: str) -> None:
        self.config = config
        self.gradwatch = config in GRADWATCH_CONFIGS
        self.run: Any = None
        self.wandb: Any = None
        self.writer: Any = None
        self.background_server: Any = None
        self.steps = 0  # this configuration's own step counter (TensorBoard's global_step)
        self.attached_to: Any = None
        if self.gradwatch:
            os.environ["GRADWATCH_HOME"] = str(workdir / "gradwatch-home")
            import gradwatch

            mode = "online" if config in ONLINE_CONFIGS else "offline"
            if mode == "online" and server_mode == "thread":
                from gradwatch.server.serve import BackgroundServer
                from gradwatch.server.settings import Settings

                db = workdir / f"gw-{config}-{os.getpid()}.db"
                self.background_server = BackgroundServer(
                    Settings(database_url=f"sqlite:///{db}"), "127.0.0.1", free_port(), with_dashboard=False
                ).start()
                server_url = self.background_server.url
            self.run = gradwatch.init(
                project="bench-overhead", name=f"{config}-{os.getpid()}", server=server_url, mode=mode
            )
            self.options: dict[str, Any] = EVERYTHING if config in ("gw_all", "gw_all_off") else {}
            if config == "gw_guard":
                self.options = {"guard": True}  # acts on incidents: the acks carry them
        elif config == "wandb":
            os.environ["WANDB_MODE"] = "offline"
            os.environ["WANDB_DIR"] = str(workdir / "wandb")
            os.environ["WANDB_SILENT"] = "true"
            os.environ["WANDB_CONSOLE"] = "off"  # keep the benchmark's own output readable
            (workdir / "wandb").mkdir(exist_ok=True)
            import wandb

            self.wandb = wandb
            self.wandb_run = wandb.init(project="gradwatch-bench", mode="offline", dir=str(workdir / "wandb"))
        elif config == "tb":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(workdir / "tensorboard" / f"{config}-{os.getpid()}"))

    def attach(self, trainer: Trainer) -> None:
        """Install this configuration's hooks on the trainer's model/optimizer/scaler (untimed)."""
        if self.gradwatch:
            self.run.watch(trainer.model, trainer.optimizer, scaler=trainer.scaler, **self.options)
        elif self.wandb is not None:
            self.wandb.watch(trainer.model, log="all", log_freq=1)
        self.attached_to = trainer

    def detach(self) -> None:
        """Remove every hook attach() installed (untimed). gradwatch: the run stays open, its step
        counter and sampling schedules continue at the next attach; buffered data waits for the next
        flush (inside this configuration's next block, as it would be in one long run)."""
        if self.gradwatch:
            watcher = self.run._watchers.pop()  # internal: a Run has no public "unwatch"
            watcher.remove()
        elif self.wandb is not None:
            self.wandb.unwatch(self.attached_to.model)
        self.attached_to = None

    def on_loss(self, loss: Any) -> None:
        if self.run is not None:
            self.run.log({"loss": loss})  # before the optimizer step: attaches to this step

    def after_step(self, loss: Any, named_parameters: list[tuple[str, Any]]) -> None:
        if self.wandb is not None:
            self.wandb.log({"loss": loss.item()})
        elif self.writer is not None:
            step = self.steps
            for name, p in named_parameters:
                self.writer.add_histogram(f"grad/{name}", p.grad, step)
                self.writer.add_histogram(name, p, step)
            self.writer.add_scalar("loss", loss.item(), step)
        self.steps += 1

    def close(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self.run is not None:
            self.run.finish(timeout=30)
            stats = self.run.stats
            info["gradwatch"] = {
                "sent": stats.sent,
                "dropped": stats.dropped,
                "queued": stats.queued,
                "last_error": stats.last_error,
            }
        if self.background_server is not None:
            self.background_server.stop()
        if self.wandb is not None:
            self.wandb_run.finish()
        if self.writer is not None:
            self.writer.close()
        return info


class Trainer:
    """A model, optimizer, scaler and synthetic data; step() runs one training step under a Monitor."""

    def __init__(
        self,
        size: ModelSize,
        seed: int,
        precision: str = "fp32",
        fused: bool = True,
        compile: bool = False,
        accumulate: int = 1,
    ) -> None:
        import torch

        self.torch = torch
        self.size = size
        self.accumulate = accumulate  # micro-batches per optimizer step, each loss divided by it
        # fp32: no autocast (the GradScaler still scales, unscales and checks, as in a loop written
        # for fp16 and run in fp32); fp16 / bf16: CPU autocast in that type.
        self.autocast_dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        torch.manual_seed(seed)
        self.model = build_model(size)
        if compile:  # forward and backward compiled (inductor); gradwatch's hooks stay outside them
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
        self.scaler = torch.amp.GradScaler("cpu")
        generator = torch.Generator().manual_seed(seed + 1)
        self.batches = [
            torch.randint(size.vocab, (size.batch, size.context + 1), generator=generator) for _ in range(64)
        ]
        self.step_index = 0
        self.named_parameters = list(self.model.named_parameters())

    def step(self, monitor: Monitor) -> None:
        torch = self.torch
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(self.accumulate):
            batch = self.batches[(self.step_index * self.accumulate + micro) % len(self.batches)]
            x, y = batch[:, :-1], batch[:, 1:]
            with torch.autocast(
                "cpu", dtype=self.autocast_dtype or torch.float32, enabled=bool(self.autocast_dtype)
            ):
                logits = self.model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, self.size.vocab), y.reshape(-1)
            )
            monitor.on_loss(loss)
            self.scaler.scale(loss / self.accumulate).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        monitor.after_step(loss, self.named_parameters)
        self.step_index += 1

    def checksum(self) -> str:
        digest = hashlib.sha256()
        for _, p in self.named_parameters:
            digest.update(p.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- instrumentation of gradwatch's own functions (profiling workers only) ----------------------------

# (owner, attribute, label, top_level). Top-level entries are what torch's hooks and gradwatch's wrappers
# call on the training thread; they do not nest in one another, so their sum is gradwatch's time there.
INSTRUMENTED = [
    (
        "watch.Watcher",
        "_on_layer_grad",
        "Watcher._on_layer_grad (each parameter's post-accumulate hook)",
        True,
    ),
    ("gradients.BackwardEnd", "hook", "  BackwardEnd.hook (queues the end of backward)", False),
    ("watch.Watcher", "_on_backward_end", "Watcher._on_backward_end (end of backward: pre-clip norms)", True),
    ("watch.Watcher", "_before_unscale", "Watcher._before_unscale (before scaler.unscale_)", True),
    ("watch.Watcher", "_after_unscale", "Watcher._after_unscale (after scaler.unscale_)", True),
    ("watch.Watcher", "_pre_step_hook", "Watcher._pre_step_hook (optimizer pre-step)", True),
    ("watch.Watcher", "_post_step_hook", "Watcher._post_step_hook (optimizer post-step)", True),
    ("watch.Watcher", "_before_scaler_step", "Watcher._before_scaler_step", True),
    ("watch.Watcher", "_after_scaler_step", "Watcher._after_scaler_step", True),
    ("watch.Watcher", "_after_update", "Watcher._after_update (after scaler.update)", True),
    ("run.Run", "log", "Run.log", True),
    ("watch.Watcher", "_settle_gradients", "  Watcher._settle_gradients (post-clip norm)", False),
    ("watch.Watcher", "_end_step", "  Watcher._end_step", False),
    ("run.Run", "_flush", "  Run._flush (every 1 s)", False),
    ("buffer.StepBuffer", "take", "    StepBuffer.take (flatten + one copy)", False),
    ("quantities", "layer_norms", "  _quantities.layer_norms", False),
    ("quantities", "global_norm", "  _quantities.global_norm", False),
    ("quantities", "log2_histograms", "  _quantities.log2_histograms", False),
    ("quantities", "snapshot", "  _quantities.snapshot", False),
    ("quantities", "update_stats", "  _quantities.update_stats (ratios + unchanged counts)", False),
]


def install_instrumentation() -> dict[str, list[float]]:
    """Wrap gradwatch's functions (before run.watch binds them) to add up inclusive wall time and
    process CPU time ([wall s, calls, CPU s] per label). CPU time does not count the time the process
    waits for a core, so on a loaded machine it is the steadier of the two."""
    from gradwatch import _buffer, _gradients, _quantities, _run, _watch

    modules = {
        "watch": _watch,
        "run": _run,
        "buffer": _buffer,
        "quantities": _quantities,
        "gradients": _gradients,
    }
    timings: dict[str, list[float]] = {}
    for owner, attribute, label, _top in INSTRUMENTED:
        module_name, _, class_name = owner.partition(".")
        target = getattr(modules[module_name], class_name) if class_name else modules[module_name]
        original = getattr(target, attribute)
        slot = timings.setdefault(label, [0.0, 0, 0.0])

        def timed(*args: Any, __original: Any = original, __slot: list = slot, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return __original(*args, **kwargs)
            finally:
                __slot[0] += time.perf_counter() - start
                __slot[1] += 1
                __slot[2] += time.process_time() - start_cpu

        setattr(target, attribute, functools.wraps(original)(timed))
    return timings


# -- worker process -----------------------------------------------------------------------------------


def worker_main(
    connection: Any,
    config: str,
    size: dict[str, int],
    seed: int,
    recipe: tuple[str, bool, bool, int],
    workdir: str,
    server_url: str | None,
    server_mode: str,
    threads: int,
    instrument: bool,
) -> None:
    """A worker process: one configuration, attached for its whole life (process isolation, profiling)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        timings = install_instrumentation() if instrument else None
        trainer = Trainer(ModelSize(**size), seed, *recipe)
        monitor = Monitor(config, Path(workdir), server_url, server_mode)
        monitor.attach(trainer)
        n_params = sum(p.numel() for _, p in trainer.named_parameters)
        connection.send(
            (
                "ready",
                {
                    "params": n_params,
                    "tensors": len(trainer.named_parameters),
                    "pid": os.getpid(),
                    "threads": torch.get_num_threads(),
                },
            )
        )
        while True:
            command, argument = connection.recv()
            if command == "steps":
                steps, settle = argument
                times = []
                cpu_start = time.process_time()
                for _ in range(steps):
                    start = time.perf_counter()
                    trainer.step(monitor)
                    times.append(time.perf_counter() - start)
                step_cpu = (time.process_time() - cpu_start) / max(steps, 1)
                time.sleep(settle)
                connection.send(("ok", (times, step_cpu) if timings is not None else times))
            elif command == "checksum":
                connection.send(
                    (
                        "ok",
                        {
                            "checksum": trainer.checksum(),
                            "steps": trainer.step_index,
                            "scale": trainer.scaler.get_scale(),
                        },
                    )
                )
            elif command == "timings":
                report = {label: list(v) for label, v in (timings or {}).items()}
                connection.send(("ok", {"timings": report, "steps": trainer.step_index}))
            elif command == "close":
                monitor.detach()
                connection.send(("ok", monitor.close()))
                return
    except BaseException as exc:  # report to the coordinator, then die
        import traceback

        connection.send(("error", f"{config}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


class Worker:
    def __init__(
        self,
        context: Any,
        config: str,
        args: argparse.Namespace,
        workdir: Path,
        server_url: str | None,
        instrument: bool = False,
    ) -> None:
        self.config = config
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=worker_main,
            name=f"bench-{config}",
            daemon=True,
            args=(
                child,
                config,
                asdict(MODEL_SIZES[args.model_size]),
                args.seed,
                (args.precision, args.optimizer == "fused", args.compile, args.accumulate),
                str(workdir),
                server_url,
                args.server,
                args.threads,
                instrument,
            ),
        )
        self.process.start()
        self.info = self._reply()

    def _reply(self) -> Any:
        status, value = self.connection.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def call(self, command: str, argument: Any = None) -> Any:
        self.connection.send((command, argument))
        return self._reply()

    def close(self) -> Any:
        info = self.call("close")
        self.process.join(60)
        return info


class ProcessRunner:
    """--isolation process: every configuration in its own worker process, with its own model."""

    def __init__(
        self,
        context: Any,
        configs: list[str],
        args: argparse.Namespace,
        workdir: Path,
        server_url: str | None,
    ) -> None:
        self.workers: dict[str, Worker] = {}
        for config in configs:
            self.workers[config] = Worker(context, config, args, workdir, server_url)
            print(f"started {config} (pid {self.workers[config].info['pid']})", file=sys.stderr, flush=True)
        self.info = self.workers[configs[0]].info
        self.skipped = {c: 0 for c in configs}

    def block(self, config: str, steps: int, settle: float) -> tuple[list[float], float]:
        roots = [self.workers[config].process.pid]
        before = tree_cpu(roots)
        times = self.workers[config].call("steps", (steps, settle))
        return times, tree_cpu(roots) - before

    def checks(self) -> dict[str, Any]:
        return {c: w.call("checksum") for c, w in self.workers.items()}

    def close(self) -> dict[str, Any]:
        closing = {c: w.close() for c, w in self.workers.items()}
        self.workers.clear()
        return closing

    def kill(self) -> None:
        for worker in self.workers.values():
            worker.process.kill()


class SharedRunner:
    """--isolation toggle (default): one process, ONE model/optimizer/scaler; each configuration's
    monitoring is attached just before its block and removed right after it (hooks, wrappers and
    gradwatch's clip_grad_norm_ patch included), so every configuration times the very same tensors
    and no process-to-process difference (memory layout, allocator state) enters the comparison."""

    def __init__(
        self,
        configs: list[str],
        args: argparse.Namespace,
        workdir: Path,
        server_url: str | None,
        exclude_pids: set[int],
    ) -> None:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        self.trainer = Trainer(
            MODEL_SIZES[args.model_size],
            args.seed,
            args.precision,
            args.optimizer == "fused",
            args.compile,
            args.accumulate,
        )
        self.monitors = {c: Monitor(c, workdir, server_url, args.server) for c in configs}
        self.exclude = exclude_pids
        self.info = {
            "params": sum(p.numel() for _, p in self.trainer.named_parameters),
            "tensors": len(self.trainer.named_parameters),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }
        self.skipped = {c: 0 for c in configs}
        self.faults: dict[str, list[float]] = {c: [] for c in configs}  # minor page faults per step, by block

    def _cpu(self) -> float:
        """This process (all threads) plus its child processes (wandb-core), not the server."""
        children = [pid for pid, (parent, _) in _proc_table().items() if parent == os.getpid()]
        return time.process_time() + tree_cpu([p for p in children if p not in self.exclude], self.exclude)

    def block(self, config: str, steps: int, settle: float) -> tuple[list[float], float]:
        import gc

        trainer, monitor = self.trainer, self.monitors[config]
        gc.collect()  # garbage of the previous block is not this one's cost
        monitor.attach(trainer)
        scale = trainer.scaler.get_scale()
        times = []
        before = self._cpu()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(steps):
            start = time.perf_counter()
            trainer.step(monitor)
            times.append(time.perf_counter() - start)
            new_scale = trainer.scaler.get_scale()  # untimed: a skipped step lowers the scale
            self.skipped[config] += new_scale < scale
            scale = new_scale
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
        self.faults[config].append(faults / max(steps, 1))
        time.sleep(settle)
        cpu = self._cpu() - before
        monitor.detach()
        return times, cpu

    def floor_ms(self, repeats: int = 30) -> float:
        """The physical floor of measuring the gradients: one torch._foreach_norm over them (as the last
        step left them), the median of `repeats` timed calls, in ms."""
        import torch

        grads = [p.grad for _, p in self.trainer.named_parameters if p.grad is not None]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch._foreach_norm(grads, 2)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    def checks(self) -> dict[str, Any]:
        return {
            "shared": {
                "checksum": "one shared model",
                "steps": self.trainer.step_index,
                "scale": self.trainer.scaler.get_scale(),
            }
        }

    def close(self) -> dict[str, Any]:
        return {c: m.close() for c, m in self.monitors.items()}

    def kill(self) -> None:
        pass


# -- CPU accounting from /proc --------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process itself: utime + stime)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = data[data.rfind(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS)
    return table


def tree_cpu(roots: list[int], exclude: set[int] | None = None) -> float:
    """CPU seconds of the given processes and all their live descendants (children reaped by a parent
    are counted in the parent's own counters only once waited for; wandb-core lives for the whole run),
    leaving out the processes in `exclude` and theirs."""
    exclude = exclude or set()
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, seen, stack = 0.0, set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid in seen or pid not in table or pid in exclude:
            continue
        seen.add(pid)
        total += table[pid][1]
        stack.extend(children.get(pid, []))
    return total


# -- statistics -------------------------------------------------------------------------------------------


def bootstrap(rounds: int, statistic: Any, resamples: int = 2000, seed: int = 1) -> tuple[float, float]:
    """95% percentile interval of statistic(indices) over resampled round indices."""
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def overhead(series: list[float], baseline: list[float], indices: list[int] | None = None) -> float:
    indices = range(len(series)) if indices is None else indices
    return sum(series[i] for i in indices) / sum(baseline[i] for i in indices) - 1.0


def fmt_pct(value: float) -> str:
    return f"{value * 100:+.1f}%"


def fmt_ci(low: float, high: float) -> str:
    return f"[{low * 100:+.1f}, {high * 100:+.1f}]"


# -- the coordinator ----------------------------------------------------------------------------------------


def start_server_process(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        server_command(port, f"sqlite:///{workdir / 'gw.db'}"),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(workdir),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gradwatch server did not start; see {workdir / 'server.log'}")
        time.sleep(0.2)


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "agent", "server"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        return f"{head}{' + uncommitted changes under agent/ or server/' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; --quick 2)")
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=None,
        help="timed steps per configuration per round (default 10; --quick 4)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per configuration first (default 4)"
    )
    parser.add_argument(
        "--gradwatch-warmup",
        type=int,
        default=None,
        help="untimed steps of each gradwatch configuration first (default 200: past the run's dense "
        "start, whose first 200 steps sample 5x as often; 0 = time the dense start too)",
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default=None,
        help="small (default, ~14M parameters), medium (~29M) or tiny (--quick)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per step (default: the model size's, 2 for small): tokens per step = batch x "
        "context. A pass over the gradients costs the same at any batch; the step grows with it",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated subset of {','.join(CONFIGS)}, or 'all' (default: all but "
        "gw_all_off and gw_guard; 'base' is always run)",
    )
    parser.add_argument(
        "--isolation",
        choices=("toggle", "process"),
        default="toggle",
        help="toggle (default): one process and one model, each configuration's monitoring "
        "attached only during its own blocks; process: one worker process and model per "
        "configuration (cleaner separation, but process-to-process speed differences of "
        "several percent enter the comparison)",
    )
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default="process",
        help="online gradwatch runs send to a server in its own process (default) or in a "
        "thread of the training process (shares its GIL)",
    )
    parser.add_argument(
        "--settle", type=float, default=None, help="seconds of pause after each block (default 0.3)"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="steps of the instrumented gradwatch workers (default 100 for defaults, "
        "a tenth of that for everything-every-step; 0 = skip)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)"
    )
    parser.add_argument(
        "--allocator",
        choices=("kept", "default"),
        default="kept",
        help="kept (default): glibc malloc keeps freed memory for reuse (fixed mmap threshold 32 MiB, "
        "no trimming; the environment of the training process, every configuration alike); default: "
        "glibc's adaptive thresholds, under which the baseline's own per-step allocations re-fault "
        "from 300 to 6,300 pages a step depending on the allocator's state",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="fp32 (default: no autocast, the issue's reference; fast on every CPU) or CPU autocast in "
        "fp16 / bf16 (about 50x slower than fp32 on AVX2-only CPUs)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("fused", "default"),
        default="fused",
        help="AdamW(fused=True) (default) or torch's default AdamW implementation for CPU tensors",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (inductor on CPU; compiles during the warm-up steps)",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step (each of --batch sequences, its loss divided by it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 short rounds: a smoke test")
    args = parser.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (2 if quick else 10)
    args.steps_per_round = args.steps_per_round or (4 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 4)
    if args.gradwatch_warmup is None:
        args.gradwatch_warmup = 0 if quick else 200
    args.model_size = args.model_size or ("tiny" if quick else "small")
    if args.batch is not None:  # a variant of the size with another batch, under the same name
        MODEL_SIZES[args.model_size] = replace(MODEL_SIZES[args.model_size], batch=args.batch)
    args.settle = args.settle if args.settle is not None else (0.2 if quick else 0.3)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (10 if quick else 100)
    if not args.configs:
        configs = [c for c in CONFIGS if c not in ("gw_all_off", "gw_guard")]  # near 10 minutes
    elif args.configs == "all":
        configs = list(CONFIGS)
    else:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if "base" not in configs:
        configs.insert(0, "base")
    args.config_list = [c for c in CONFIGS if c in configs]
    return args


def _warmup(args: argparse.Namespace, config: str) -> int:
    """Untimed steps before a configuration's first block: a gradwatch run also passes its dense start
    (the first dense_start_steps steps sample 5x as often), so the timed steps show the steady state."""
    return max(args.warmup, args.gradwatch_warmup) if config.startswith("gw") else args.warmup


# glibc malloc settings of --allocator kept: read once, when the process starts (hence the re-exec).
KEPT_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.allocator == "kept" and any(os.environ.get(k) != v for k, v in KEPT_ALLOCATOR.items()):
        os.environ.update(KEPT_ALLOCATOR)
        if argv is None:  # run as a script: start again with the allocator settings in force
            os.execv(sys.executable, [sys.executable, *sys.argv])
    # Idle OpenMP threads sleep instead of spinning, so CPU seconds measure work, not waiting (workers
    # inherit this; it applies to every configuration alike).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    context = mp.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="gw-bench-overhead-"))
    configs = args.config_list
    started = time.monotonic()
    server = None
    server_url = None
    runner: Any = None
    try:
        if args.server == "process" and ONLINE_CONFIGS & set(configs):
            server, server_url = start_server_process(workdir)
        if args.isolation == "process":
            runner = ProcessRunner(context, configs, args, workdir, server_url)
        else:
            runner = SharedRunner(
                configs, args, workdir, server_url, {server.pid} if server is not None else set()
            )
        for config in configs:
            runner.block(config, _warmup(args, config), 0.0)
        wall: dict[str, list[float]] = {c: [] for c in configs}  # mean step time per round (s)
        cpu: dict[str, list[float]] = {c: [] for c in configs}  # CPU seconds per step per round
        server_cpu: dict[str, list[float]] = {c: [] for c in configs}
        step_times: dict[str, list[float]] = {c: [] for c in configs}
        print(f"warmed up at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for config in order:
                measure_server = server is not None and config in ONLINE_CONFIGS
                server_before = tree_cpu([server.pid]) if measure_server else 0.0
                times, cpu_seconds = runner.block(config, args.steps_per_round, args.settle)
                server_after = tree_cpu([server.pid]) if measure_server else 0.0
                wall[config].append(sum(times) / len(times))
                step_times[config].extend(times)
                server_cpu[config].append((server_after - server_before) / len(times))
                cpu[config].append(cpu_seconds / len(times))
            print(
                f"round {r + 1}/{args.rounds} done at {time.monotonic() - started:.0f} s: "
                + ", ".join(f"{c} {wall[c][-1] * 1000:.0f}" for c in configs)
                + " ms",
                file=sys.stderr,
                flush=True,
            )
        checks = runner.checks()
        if isinstance(runner, SharedRunner):
            runner.info["floor_ms"] = runner.floor_ms()
        closing = runner.close()
        info, skipped = runner.info, runner.skipped
        # the timed blocks' page faults (the warm-up block first is left out); none with process isolation
        faults = {c: v[-args.rounds :] for c, v in getattr(runner, "faults", {}).items()}
        runner = None
        profiles = {}
        if args.profile_steps > 0:
            for config, steps in (("gw", args.profile_steps), ("gw_all", max(args.profile_steps // 10, 2))):
                if config not in configs and config + "_off" not in configs:
                    continue
                url = server_url if config in configs else None
                name = config if config in configs else config + "_off"
                worker = Worker(context, name, args, workdir, url, instrument=True)
                worker.call("steps", (_warmup(args, name), 0.0))
                profiles[name] = profile_run(worker, steps)
                worker.close()
        elapsed = time.monotonic() - started
        report(
            args,
            configs,
            wall,
            cpu,
            server_cpu,
            step_times,
            checks,
            closing,
            profiles,
            elapsed,
            info,
            skipped,
            faults,
        )
    finally:
        if runner is not None:
            runner.kill()
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def profile_run(worker: Worker, steps: int) -> dict[str, Any]:
    before = worker.call("timings", False)["timings"]  # warm-up's counts, subtracted below
    times, step_cpu = worker.call("steps", (steps, 0.0))
    after = worker.call("timings", True)
    rows = []
    for label, (seconds, calls, cpu_seconds) in after["timings"].items():
        seconds -= before.get(label, [0.0, 0, 0.0])[0]
        calls -= before.get(label, [0.0, 0, 0.0])[1]
        cpu_seconds -= before.get(label, [0.0, 0, 0.0])[2]
        rows.append((label, seconds, calls, cpu_seconds))
    return {
        "rows": rows,
        "steps": steps,
        "step_time": statistics.median(times),
        "mean_step_time": statistics.mean(times),
        "step_cpu": step_cpu,
    }


def report(
    args: argparse.Namespace,
    configs: list[str],
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
    server_cpu: dict[str, list[float]],
    step_times: dict[str, list[float]],
    checks: dict[str, Any],
    closing: dict[str, Any],
    profiles: dict[str, Any],
    elapsed: float,
    info: dict[str, Any],
    skipped: dict[str, int],
    faults: dict[str, list[float]],
) -> None:
    import torch

    size = MODEL_SIZES[args.model_size]
    rounds = args.rounds
    base_wall, base_cpu = wall["base"], cpu["base"]
    out = print
    command = "python bench/agent_overhead.py " + " ".join(sys.argv[1:])
    out(f"### Agent overhead: {args.model_size} model, {rounds} rounds x {args.steps_per_round} steps\n")
    out(f"- command: `{command.strip()}`")
    first_check = next(iter(checks.values()))
    out(
        f"- machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}, torch CPU "
        f"capability {torch.backends.cpu.get_cpu_capability()}), "
        f"torch {torch.__version__}, {info['threads']} intra-op threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), allocator {args.allocator} "
        f"(MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}, "
        f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}), "
        f"Python {platform.python_version()}, "
        f"gradwatch at {git_state()}"
    )
    out(
        f"- model: GPT-style decoder, vocab {size.vocab}, context {size.context}, width {size.width}, "
        f"{size.layers} layers, {size.heads} heads: {info['params'] / 1e6:.1f}M parameters in "
        f"{info['tensors']} tensors; batch {size.batch} x {size.context} tokens"
        + (
            f", {args.accumulate} micro-batches a step (loss / {args.accumulate})"
            if args.accumulate > 1
            else ""
        )
        + "; "
        f"{args.precision}{' autocast' if args.precision != 'fp32' else ''} + GradScaler + "
        f"{args.optimizer} AdamW + clip_grad_norm_(1.0)"
        + ("; model compiled (torch.compile)" if args.compile else "")
    )
    out(
        f"- isolation: {args.isolation}; online gradwatch server: "
        f"{'own process' if args.server == 'process' else 'thread in the training process'}, "
        f"SQLite; settle pause {args.settle} s after each block; gradwatch runs warmed up for "
        f"{args.gradwatch_warmup} steps first; total time {elapsed:.0f} s\n"
    )
    out(
        "| configuration | step ms, median of rounds [min, max] | wall overhead [95% CI] | "
        "median of per-round overheads | CPU ms/step, training side | CPU overhead, training side [95% CI] | "
        "server CPU ms/step | page faults/step, median of rounds |"
    )
    out("|---|---|---|---|---|---|---|---|")
    for config in configs:
        w = [v * 1000 for v in wall[config]]
        paired = statistics.median(wall[config][i] / base_wall[i] - 1 for i in range(rounds))
        server_part = statistics.mean(server_cpu[config]) * 1000
        server_text = f"{server_part:.1f}" if config in ONLINE_CONFIGS and args.server == "process" else "—"
        if config == "base":
            wall_text = cpu_text = "—"
            paired_text = "—"
        else:
            wall_text = (
                f"{fmt_pct(overhead(wall[config], base_wall))} "
                f"{fmt_ci(*bootstrap(rounds, lambda ix, c=config: overhead(wall[c], base_wall, ix)))}"
            )
            cpu_text = (
                f"{fmt_pct(overhead(cpu[config], base_cpu))} "
                f"{fmt_ci(*bootstrap(rounds, lambda ix, c=config: overhead(cpu[c], base_cpu, ix)))}"
            )
            paired_text = fmt_pct(paired)
        out(
            f"| {CONFIGS[config]} | {statistics.median(w):.0f} [{min(w):.0f}, {max(w):.0f}] | {wall_text} | "
            f"{paired_text} | {statistics.mean(cpu[config]) * 1000:.0f} | {cpu_text} | {server_text} | "
            f"{f'{statistics.median(faults[config]):.0f}' if faults.get(config) else '—'} |"
        )
    out("")
    for ours, theirs in (("gw_all", "wandb"), ("gw_all_off", "wandb")):
        if ours not in configs or theirs not in configs:
            continue
        for label, table, base in (("wall", wall, base_wall), ("CPU", cpu, base_cpu)):

            def ratio(
                ix: list[int] | None, a: str = ours, b: str = theirs, t: Any = table, bs: Any = base
            ) -> float:
                return overhead(t[a], bs, ix) / overhead(t[b], bs, ix)

            low, high = bootstrap(rounds, ratio)
            out(
                f"- ratio overhead({ours}) / overhead({theirs}), {label}: {ratio(None):.3f} "
                f"[95% CI {low:.3f}, {high:.3f}]"
            )
    if "floor_ms" in info:
        floor = info["floor_ms"]
        base_ms = statistics.median(base_wall) * 1000
        for config in configs:
            if config not in GRADWATCH_CONFIGS:
                continue
            added = statistics.median(wall[config]) * 1000 - base_ms
            out(
                f"- {config}: adds {added:.2f} ms a step (median of rounds, against the baseline's "
                f"{base_ms:.1f}); the floor, one torch._foreach_norm over the {info['tensors']} gradients "
                f"(median of 30): {floor:.2f} ms; added / floor = {added / floor:.1f}x"
            )
    per_step_medians = ", ".join(f"{c} {statistics.median(step_times[c]) * 1000:.0f}" for c in configs)
    out(f"- median of all single steps (ms): {per_step_medians}")
    if args.isolation == "process":
        sums = {check["checksum"] for check in checks.values()}
        out(
            f"- parameters after {first_check['steps']} steps identical in every configuration: "
            f"{'yes' if len(sums) == 1 else 'NO: ' + str(checks)} (loss scale now {first_check['scale']:.0f})"
        )
    else:
        out(
            f"- one shared model trained {first_check['steps']} steps in all; loss scale now "
            f"{first_check['scale']:.0f}; skipped steps in timed blocks: "
            + ", ".join(f"{c} {n}" for c, n in skipped.items())
        )
    for config, closed in closing.items():
        if closed.get("gradwatch"):
            out(f"- {config}: {closed['gradwatch']}")
    for config, profile in profiles.items():
        steps = profile["steps"]
        out(
            f"\n#### Inside gradwatch ({config}: {steps} instrumented steps, median step "
            f"{profile['step_time'] * 1000:.0f} ms, mean {profile['mean_step_time'] * 1000:.0f} ms, process "
            f"CPU {profile['step_cpu'] * 1000:.0f} ms per step; inclusive wall and process-CPU time on the "
            "training thread)\n"
        )
        out("| function | wall ms/step | CPU ms/step | calls/step | wall ms/call |")
        out("|---|---|---|---|---|")
        top_total = top_cpu = 0.0
        for (label, seconds, calls, cpu_seconds), (_, _, _, top) in zip(
            profile["rows"], INSTRUMENTED, strict=True
        ):
            if top:
                top_total += seconds
                top_cpu += cpu_seconds
            if calls:
                out(
                    f"| {label} | {seconds / steps * 1000:.3f} | {cpu_seconds / steps * 1000:.3f} "
                    f"| {calls / steps:.2f} | {seconds / calls * 1000:.3f} |"
                )
        out(
            f"| **total of the top-level entries** | **{top_total / steps * 1000:.3f}** "
            f"| **{top_cpu / steps * 1000:.3f}** | | |"
        )
        out(
            f"\ngradwatch's share of the step: {top_total / steps / profile['mean_step_time']:.2%} of the "
            f"mean step's wall time, {top_cpu / steps / profile['step_cpu']:.2%} of its process CPU time"
        )


if __name__ == "__main__":
    sys.exit(main())
