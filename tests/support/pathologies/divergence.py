"""Divergences that stay finite: the loss leaves the range it had reached and never turns NaN, so only a
rule that remembers the run's best level sees it (loss_divergence).

`lr_restart_100x`: a post-LayerNorm transformer language model (torch's TransformerEncoderLayer,
norm_first=False) trained with Adam at 3e-3 learns a Markov corpus; at step 150 a warm restart meant to
ramp back to 3e-3 over 50 steps is given a peak 100x too high (a mistyped peak lr), so the loss climbs
from ~1 to ~5 within ~10 steps and keeps climbing, finite, for the rest of the run.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn

from .harness import RunFactory, Scenario, _gradwatch, _require, _timed, _Trace
from .nanogpt import BLOCK, VOCAB, _one_thread

RESTART_AT = 150


def divergence_step(losses: list[float], after: int = 20) -> int | None:
    """Where the loss left its range: the first non-finite loss, or the first step after `after` whose
    median of 5 losses is over 3x the lowest such median before it (bench/early_warning.py's definition)."""
    best = math.inf
    for i in range(len(losses)):
        window = losses[max(0, i - 4) : i + 1]
        if not all(math.isfinite(v) for v in window):
            return i
        level = statistics.median(window)
        if i >= after and level > 3 * best:
            return i
        best = min(best, level)
    return None


def _markov_stream(seed: int, length: int, temperature: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    cumulative = torch.softmax(temperature * torch.randn(VOCAB, VOCAB, generator=generator), -1).cumsum(-1)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    draws = torch.rand(length, generator=generator)
    for i in range(1, length):
        tokens[i] = min(int(torch.searchsorted(cumulative[tokens[i - 1]], draws[i])), VOCAB - 1)
    return tokens


class PostLNLanguageModel(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(BLOCK, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        h = self.embed(x) + self.position(torch.arange(x.size(1)))
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    batches: torch.Generator,
    run: Any,
    trace: _Trace,
) -> None:
    """One optimizer step on 8 random windows of `data`, the loss logged as a user logs it; the trace
    takes the loss, the pre-clip norm (measured by clip_grad_norm_ at inf: no clip) and the lr."""
    ix = torch.randint(len(data) - BLOCK - 1, (8,), generator=batches).tolist()
    x = torch.stack([data[i : i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
    loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    if run is not None:
        run.log({"loss": loss.detach()})
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    trace.add(loss, norm, lr)


def restart_lr(step: int, base: float = 3e-3, peak_factor: float = 100.0, ramp: int = 50) -> float:
    """3e-3, then from RESTART_AT a linear ramp over `ramp` steps to peak_factor x base."""
    if step < RESTART_AT:
        return base
    return base * min(peak_factor, 1 + (peak_factor - 1) * (step - RESTART_AT + 1) / ramp)


@_timed
def lr_restart_100x(new_run: RunFactory | None = None) -> Scenario:
    """A warm restart to a peak lr 100x too high: a finite divergence (see the module)."""
    s = Scenario("lr_restart_100x", "divergence", None)
    torch.manual_seed(0)
    data = _markov_stream(0, 20_000, temperature=5.0)
    batches = torch.Generator().manual_seed(0)
    with _one_thread():
        model = PostLNLanguageModel()
        optimizer = torch.optim.Adam(model.parameters(), lr=restart_lr(0))
        trace = _Trace(s)
        with _gradwatch(new_run, s, model, optimizer, lr=3e-3) as run:
            for step in range(260):
                for group in optimizer.param_groups:
                    group["lr"] = restart_lr(step)
                _train_step(model, optimizer, data, batches, run, trace)
    before = statistics.median(s.losses[RESTART_AT - 20 : RESTART_AT])
    after = [statistics.median(s.losses[i : i + 5]) for i in range(RESTART_AT, len(s.losses) - 4)]
    s.onset_step = RESTART_AT
    s.facts = {
        "loss_before_restart": round(before, 3),
        "loss_after_max": round(max(after), 3),
        "diverged_at": next((RESTART_AT + i for i, v in enumerate(after) if v > 3 * before), None),
        "all_finite": all(math.isfinite(v) for v in s.losses),
    }
    _require(
        s.facts["all_finite"] and s.facts["diverged_at"] is not None and after[-1] > 3 * before,
        f"the restart does not make the loss leave its range and stay out, finite: {s.facts}",
    )
    return s


def _post_ln_warmup_run(
    name: str, new_run: RunFactory | None, seed: int, steps: int, peak: float, ramp: int
) -> Scenario:
    """The post-LN language model with Adam, a linear warm-up over `ramp` steps to `peak`, then constant:
    a run that learns and then leaves its range, finite (checked)."""
    s = Scenario(name, "divergence", None)
    torch.manual_seed(seed)
    data = _markov_stream(0, 20_000, temperature=7.0)
    batches = torch.Generator().manual_seed(seed)
    with _one_thread():
        model = PostLNLanguageModel()
        optimizer = torch.optim.Adam(model.parameters(), lr=peak)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / ramp))
        trace = _Trace(s)
        with _gradwatch(new_run, s, model, optimizer, lr=peak, warmup_steps=ramp) as run:
            for _ in range(steps):
                _train_step(model, optimizer, data, batches, run, trace)
                schedule.step()
    s.onset_step = divergence_step(s.losses)
    tail = s.losses[-20:]
    s.facts = {
        "lowest_loss": round(min(s.losses), 3),
        "diverged_at": s.onset_step,
        "final_median": round(statistics.median(tail), 3),
        "all_finite": all(math.isfinite(v) for v in s.losses),
    }
    _require(
        s.onset_step is not None and s.onset_step > 40 and s.facts["all_finite"],
        f"the run did not learn and then leave its range, finite: {s.facts}",
    )
    return s


@_timed
def post_ln_no_warmup(new_run: RunFactory | None = None, seed: int = 0, steps: int = 360) -> Scenario:
    """A post-LN transformer at a constant Adam lr of 1e-2 with no real warm-up (5 steps): it learns to
    ~0.5, then diverges (step ~170 here) and stays near 3.4, finite."""
    return _post_ln_warmup_run("post_ln_no_warmup", new_run, seed, steps, peak=1e-2, ramp=5)


@_timed
def warmup_too_fast(
    new_run: RunFactory | None = None, seed: int = 0, steps: int = 160, peak: float = 2e-2, ramp: int = 60
) -> Scenario:
    """The same model warmed up linearly over 60 steps to Adam 2e-2: the ramp outruns what the model can
    take. It learns to ~0.6, then as the lr passes ~1.3e-2 the gradient norm spikes more and more often
    and the loss leaves its range before the ramp ends (step 54 here; 47-96 with other seeds and peaks)
    and stays near 3.3, finite."""
    return _post_ln_warmup_run("warmup_too_fast", new_run, seed, steps, peak=peak, ramp=ramp)
