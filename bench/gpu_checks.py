"""GPU checks (issue 18, point 4), one script that fits in a few minutes of a lent device:

    .venv/bin/python bench/gpu_checks.py                      # on a CUDA machine
    .venv/bin/python bench/gpu_checks.py --device cpu --tiny  # smoke test of the script itself (no GPU)

1. No host-device synchronisation at gradwatch's defaults: a real fp16 loop (torch.autocast +
   torch.amp.GradScaler + clip_grad_norm_) and a real bf16 loop (autocast, no scaler), each watched by
   gradwatch (mode="offline"), run their timed steps under torch.cuda.set_sync_debug_mode("error"),
   which raises on any synchronising call. The loop's own code avoids them (no .item(), no
   printing of tensors), so an error can only come from gradwatch; the script says which step and
   prints the traceback.
2. Overhead on a ~1B-parameter GPT-style model (bf16 autocast, fused AdamW, clip_grad_norm_):
   interleaved blocks of no monitoring, gradwatch defaults (offline) and wandb.watch(log="all",
   log_freq=100) (offline, when wandb is installed), each block's steps timed with CUDA events; the
   medians of the blocks' mean step times and the ratios to no monitoring.

What it prints goes into BENCHMARKS.md ("GPU") with the device's name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def build(width: int, layers: int, heads: int, vocab: int, context: int, device: str) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: Any) -> Any:
            h = self.ln1(x)
            mask = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=torch.bool).triu(1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            return self.head(self.ln(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]])))

    return GPT().to(device)


class Loop:
    """One model, optimizer and (fp16) scaler; step() is one training step without a host sync."""

    def __init__(self, args: argparse.Namespace, dtype: str, size: dict[str, int]) -> None:
        import torch

        self.torch, self.device = torch, args.device
        self.model = build(**size, device=args.device)
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        fused = args.device == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.scaler = torch.amp.GradScaler(args.device) if dtype == "fp16" else None
        generator = torch.Generator(device="cpu").manual_seed(0)
        self.batches = [
            torch.randint(size["vocab"], (args.batch, size["context"] + 1), generator=generator).to(
                args.device
            )
            for _ in range(8)
        ]
        self.vocab, self.index = size["vocab"], 0

    def step(self, run: Any = None) -> None:
        torch = self.torch
        batch = self.batches[self.index % len(self.batches)]
        self.index += 1
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.dtype):
            logits = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, self.vocab), batch[:, 1:].reshape(-1)
        )
        if run is not None:
            run.log({"loss": loss})  # a device tensor: gradwatch keeps it there until its flush
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()


def sync_check(args: argparse.Namespace, dtype: str) -> bool:
    """True when `steps` watched steps ran under set_sync_debug_mode("error") without an error."""
    import torch

    import gradwatch

    size = {"width": 256, "layers": 4, "heads": 4, "vocab": 4096, "context": 128}
    loop = Loop(args, dtype, size)
    run = gradwatch.init(project="gpu-checks", name=f"sync-{dtype}", mode="offline")
    run.watch(loop.model, loop.optimizer, scaler=loop.scaler)
    for _ in range(3):  # warm-up outside the check: first-call allocations, cuBLAS handles
        loop.step(run)
    cuda = args.device == "cuda"

    def steps_without_sync(watched: bool) -> bool:
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            for step in range(args.sync_steps):
                try:
                    loop.step(run if watched else None)
                except RuntimeError:
                    who = "gradwatch's defaults" if watched else "the loop alone (torch itself)"
                    print(f"  {dtype}: a synchronising call at step {step}, with {who}:")
                    traceback.print_exc()
                    return False
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        return True

    # The loop alone first (its watcher detached): a sync there is torch's, not gradwatch's.
    watcher = run._watchers.pop()  # internal, as in bench/agent_overhead.py: no public unwatch
    watcher.remove()
    if not steps_without_sync(watched=False):
        run.finish()
        return False
    run.watch(loop.model, loop.optimizer, scaler=loop.scaler)
    ok = steps_without_sync(watched=True)
    run.finish()
    print(f"  {dtype}: {'no' if ok else 'a'} host-device sync in {args.sync_steps} watched steps")
    return ok


def overhead(args: argparse.Namespace) -> None:
    import torch

    import gradwatch

    size = (
        {"width": 2048, "layers": 18, "heads": 16, "vocab": 32000, "context": 256}
        if not args.tiny
        else {"width": 64, "layers": 2, "heads": 2, "vocab": 512, "context": 32}
    )
    loop = Loop(args, "bf16", size)
    params = sum(p.numel() for p in loop.model.parameters())
    print(
        f"overhead: {params / 1e9:.2f}B parameters, batch {args.batch} x {size['context']},"
        " bf16 autocast, fused AdamW"
    )
    run = gradwatch.init(project="gpu-checks", name="overhead", mode="offline")
    wandb_run = None
    try:
        import wandb

        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tempfile.mkdtemp())
        wandb_run = wandb.init(project="gpu-checks")
    except ImportError:
        print("  (wandb not installed: its column is left out)")
    configs = ["none", "gradwatch"] + (["wandb"] if wandb_run is not None else [])
    cuda = args.device == "cuda"
    means: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(2):
        loop.step()
    for block in range(args.blocks):
        for config in configs[block % len(configs) :] + configs[: block % len(configs)]:
            if config == "gradwatch":
                run.watch(loop.model, loop.optimizer)
            elif config == "wandb":
                wandb.watch(loop.model, log="all", log_freq=100)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
            began = time.perf_counter()
            for _ in range(args.steps_per_block):
                loop.step(run if config == "gradwatch" else None)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1000
            else:
                seconds = time.perf_counter() - began
            means[config].append(seconds / args.steps_per_block)
            if config == "gradwatch":
                run._watchers.pop().remove()  # internal, as in bench/agent_overhead.py: no public unwatch
            elif config == "wandb":
                wandb.unwatch(loop.model)
    base = statistics.median(means["none"])
    for config in configs:
        median = statistics.median(means[config])
        print(
            f"  {config:9s}: {median * 1000:8.1f} ms/step (median of {args.blocks} blocks),"
            f" {median / base:.3f}x"
        )
    run.finish()
    if wandb_run is not None:
        wandb_run.finish()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model for --device cpu smoke tests")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sync-steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps-per-block", type=int, default=10)
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on a lent GPU machine, or --device cpu --tiny to test the script")
        return 2
    if args.tiny:
        args.batch, args.sync_steps, args.blocks, args.steps_per_block = 2, 5, 3, 2
    name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    )
    print(f"device: {name}; torch {torch.__version__}")
    os.environ.setdefault("GRADWATCH_HOME", str(Path(tempfile.mkdtemp()) / "gradwatch"))
    print("sync check (set_sync_debug_mode('error') around watched steps):")
    results = [sync_check(args, dtype) for dtype in ("fp16", "bf16")]
    overhead(args)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
