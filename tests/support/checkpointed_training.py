"""A training job as users write one, run as its own process by the crash and resume tests: fp16
autocast on CPU with a real GradScaler, a checkpoint (model, optimizer, scaler state, run id, step)
written at --checkpoint-at, and, with --resume, the restart that continues from that checkpoint
with resume="must" at half the learning rate (the advice for a run that went wrong).

    python checkpointed_training.py --server URL --project P --checkpoint FILE --record FILE
        [--steps N] [--checkpoint-at K] [--step-delay S] [--raise-at STEP] [--resume]

--record gets one JSON line per optimizer step ({"step", "loss", "scale", "skipped"}), flushed as it goes, so
the test knows what each attempt computed even after a SIGKILL. --raise-at ends the loop with an
uncaught ValueError (no context manager: the exit hook reports the crash).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

import gradwatch


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data at the same step in every attempt."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--checkpoint-at", type=int, default=30)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)
    checkpoint = torch.load(args.checkpoint, weights_only=False) if args.resume else None

    run = gradwatch.init(
        project=args.project,
        name="checkpointed",
        server=args.server,
        run_id=checkpoint["run_id"] if checkpoint else None,
        resume="must" if checkpoint else None,
        flush_interval=0.05,
    )
    run.watch(model, optimizer, scaler=scaler)
    start = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])  # watched: a scaler_state_loaded event
        for group in optimizer.param_groups:
            group["lr"] /= 2
        start = run.step = checkpoint["step"]

    with open(args.record, "a", encoding="utf-8") as record:
        for step in range(start, args.steps):
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            run.log({"loss": loss})
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < scale_before  # the scaler backs off only when it skips
            line = {"step": step, "loss": loss.item(), "scale": scaler.get_scale(), "skipped": skipped}
            record.write(json.dumps(line) + "\n")
            record.flush()
            if args.raise_at is not None and step == args.raise_at:
                raise ValueError(f"loss exploded at step {step}")
            if not args.resume and step + 1 == args.checkpoint_at:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "run_id": run.id,  # the checkpoint pattern: the run id travels with the weights
                    "step": step + 1,  # the next step to train
                }
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            time.sleep(args.step_delay)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
