"""How many times gradwatch reads the gradients per optimizer step (issue 40): the physical floor is one.

    .venv/bin/python bench/gradient_reads.py [--steps 40] [--model-size small]

bench/agent_overhead.py's model and loop (GradScaler, unscale_, clip_grad_norm_(1.0), fused AdamW; fp32)
train under gradwatch at its defaults (offline), once with one micro-batch a step and once with 4 (each
loss divided by 4), while torch's norm functions are wrapped to count the elements they read
(torch._foreach_norm, torch.linalg.vector_norm, torch.norm, Tensor.norm), in the loop's own code and in
gradwatch's, separately: the clip reads every gradient once by itself, and gradwatch's reads are what it adds.
Reported per optimizer step: gradwatch's reads of the gradients (elements read / elements of all the
gradients), after a warm-up past the run's dense start (gradwatch's dense_start_steps=0 here, so every
step is at its steady-state schedule), and on which steps they happen. Counts, not times: repeatable on
any machine. The per-layer sampling steps (layer_norms_every=20) read once more by design.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[1] / "tests" / "support"),
]
from _common import cpu_name  # noqa: E402
from agent_overhead import MODEL_SIZES, Monitor, Trainer  # noqa: E402
from norm_reads import CountNormReads  # noqa: E402


def measure(accumulate: int, steps: int, size_name: str, workdir: Path) -> dict[str, object]:
    args = argparse.Namespace(model_size=size_name)
    trainer = Trainer(MODEL_SIZES[args.model_size], 0, "fp32", True, False, accumulate)
    total = sum(p.numel() for _, p in trainer.named_parameters)
    monitor = Monitor("gw_off", workdir, None, "process")
    monitor.options = {"dense_start_steps": 0}
    monitor.attach(trainer)
    for _ in range(5):  # warm-up: the run's first steps (setup checks) are not the steady state
        trainer.step(monitor)
    per_step = []
    for _ in range(steps):
        with CountNormReads() as counting:
            trainer.step(monitor)
        per_step.append(
            (
                counting.elements["gradwatch"] / total,
                counting.elements["loop"] / total,
                trainer.step_index - 1,
            )
        )
    monitor.detach()
    monitor.close()
    ours = [reads for reads, _, _ in per_step]
    loop = [reads for _, reads, _ in per_step]
    sampled = [step for reads, _, step in per_step if reads > min(ours) + 0.5]
    return {
        "accumulate": accumulate,
        "gradwatch_min": min(ours),
        "gradwatch_mean": sum(ours) / len(ours),
        "gradwatch_max": max(ours),
        "loop": sum(loop) / len(loop),
        "steps_with_more": sampled,
        "tensors": len(trainer.named_parameters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    args = parser.parse_args()
    print(
        f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )
    print(
        "| micro-batches a step | gradwatch's reads a step: typical (mean, max) | the loop's own "
        "| steps reading more |"
    )
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GRADWATCH_HOME"] = tmp
        for accumulate in (1, 4):
            row = measure(accumulate, args.steps, args.model_size, Path(tmp))
            print(
                f"| {row['accumulate']} | {row['gradwatch_min']:.2f} ({row['gradwatch_mean']:.2f}, "
                f"{row['gradwatch_max']:.2f}) | {row['loop']:.2f} | {row['steps_with_more']} |"
            )


if __name__ == "__main__":
    main()
