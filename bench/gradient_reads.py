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
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_name
from agent_overhead import MODEL_SIZES, Monitor, Trainer


class CountNormReads:
    """Counts the elements the norm functions read while it is entered, split by whether gradwatch's
    code called them. It wraps torch's Python entry points (torch._foreach_norm, torch.linalg.vector_norm,
    torch.norm, Tensor.norm) for the block: a TorchDispatchMode does not see what runs in autograd's
    callbacks at the end of backward, where gradwatch measures."""

    TARGETS = (
        (torch, "_foreach_norm"),
        (torch.linalg, "vector_norm"),
        (torch, "norm"),
        (torch.Tensor, "norm"),
    )

    def __init__(self) -> None:
        self.elements: Counter[str] = Counter()
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> CountNormReads:  # noqa: PYI034
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._counting(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _counting(self, original):  # type: ignore[no-untyped-def]
        def counted(first, *args, **kwargs):  # type: ignore[no-untyped-def]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            count = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
            self.elements["gradwatch" if _from_gradwatch() else "loop"] += count
            return original(first, *args, **kwargs)

        return counted


def _from_gradwatch() -> bool:
    return any(
        f"{os.sep}agent{os.sep}" in frame.filename or f"{os.sep}gradwatch{os.sep}" in frame.filename
        for frame in traceback.extract_stack()
    )


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
