"""The Watcher's options: when each sampled quantity is taken (a schedule: optimizer step -> bool),
which ranks take histograms, and throughput hints. Checked when built: a bad value is a ValueError
naming it, before any hook is installed."""

from __future__ import annotations

from dataclasses import dataclass

from . import _distributed


@dataclass(frozen=True)
class WatchOptions:
    """Sampling schedules (every N optimizer steps; 0 turns a quantity off) and throughput hints.

    Defaults keep the cost near zero: scale, skips, global norm and lr every step; per-layer
    gradient norms every 20 steps; parameter norms, histograms and update ratios every 100.

    dense_start_steps: during the first this many optimizer steps (default 200; 0 = off) each
    sampled quantity is also taken every max(1, every // 5) steps, so that problems present from the
    start (a detached layer, underflowing adapters, bf16 weights that never change) show within ~20
    steps; the steady-state cost is unchanged.

    histogram_ranks: which ranks of a distributed job take the gradient histograms. "auto" (default):
    rank 0 alone when gradients are replicated (DDP: every rank would send the same counts), every
    rank when they are sharded (FSDP: each rank counts its shard; the shards' counts add up); "all";
    or a collection of ranks, e.g. (0, 4).
    """

    layer_norms_every: int = 20
    param_norms_every: int = 100
    histograms_every: int = 100
    update_ratio_every: int = 100
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    histogram_ranks: str | tuple[int, ...] | frozenset[int] = "auto"
    dense_start_steps: int = 200

    def __post_init__(self) -> None:
        for name in ("layer_norms_every", "param_norms_every", "histograms_every", "update_ratio_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number of steps >= 0 (0 = off), got {value!r}")
        dense = self.dense_start_steps
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ValueError(
                f"dense_start_steps must be a whole number of steps >= 0 (0 = off), got {dense!r}"
            )
        for name in ("samples_per_step", "tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        ranks = self.histogram_ranks
        if isinstance(ranks, str):
            if ranks not in ("auto", "all"):
                raise ValueError(
                    f"histogram_ranks must be 'auto', 'all' or a collection of ranks, got {ranks!r}"
                )
        else:
            try:
                chosen = frozenset(ranks)
            except TypeError:
                raise ValueError(
                    f"histogram_ranks must be 'auto', 'all' or a collection of ranks, got {ranks!r}"
                ) from None
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in chosen):
                raise ValueError(f"histogram_ranks must hold whole numbers >= 0, got {ranks!r}")
            object.__setattr__(self, "histogram_ranks", chosen)

    def takes_histograms(self, rank: int, layout: str) -> bool:
        """Whether `rank` takes gradient histograms for a model whose gradients have `layout`."""
        if self.histogram_ranks == "all":
            return True
        if self.histogram_ranks == "auto":
            return rank == 0 or layout != _distributed.REPLICATED
        return rank in self.histogram_ranks

    def due(self, every: int, step: int) -> bool:
        """Whether a quantity sampled every `every` optimizer steps (one of the *_every options; 0 =
        off) is taken at `step`: every `every` steps, and every max(1, every // 5) steps while
        step < dense_start_steps."""
        if every <= 0:
            return False
        if step < self.dense_start_steps:
            every = max(1, every // 5)
        return step % every == 0
