"""nanoGPT's training loop (karpathy/nanoGPT train.py), shrunk to run on a CPU in seconds: its GPT
(pre-LayerNorm blocks, causal self-attention, tied embedding), its AdamW groups (weight decay on 2-D
weights only, betas 0.9/0.95), its warm-up + cosine lr, and its step: each micro-batch's loss divided by
gradient_accumulation_steps, `scaler.scale(loss).backward()`, then `scaler.unscale_`, `clip_grad_norm_`,
`scaler.step`, `scaler.update`, `zero_grad(set_to_none=True)`. The GradScaler is nanoGPT's too:
`GradScaler(enabled=(dtype == "float16"))`, so fp32 runs go through a disabled one.

Early in training its pre-clip norm sits a little above the clip on nearly every step (1.2-1.5x here, as
in the real script at the start): normal, and the healthy controls below check that it stays silent.
`nanogpt_undivided` forgets the division, the mistake a summed-loss diagnosis is for: its norm is then
about gradient_accumulation_steps times larger.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .harness import RunFactory, Scenario, _gradwatch, _require, _timed, _Trace

VOCAB = 64
BLOCK = 32


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = _CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """nanoGPT's GPT: token + position embeddings, pre-LN blocks, final LayerNorm, a head tied to the
    token embedding; weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer))."""

    def __init__(self, n_embd: int, n_layer: int = 2, n_head: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(BLOCK, n_embd)
        self.h = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def _token_stream(seed: int, length: int) -> torch.Tensor:
    """A corpus with structure to learn: a fixed random Markov chain over VOCAB tokens."""
    generator = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    draws = torch.rand(length, generator=generator)
    cumulative = transitions.cumsum(dim=-1)
    for i in range(1, length):
        tokens[i] = min(int(torch.searchsorted(cumulative[tokens[i - 1]], draws[i])), VOCAB - 1)
    return tokens


def _get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int) -> float:
    """nanoGPT's get_lr: linear warm-up, cosine decay to learning_rate / 10."""
    min_lr = learning_rate / 10
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Attention on a 2-core machine shared by two test workers: torch's threads spin against each other
    (40x slower). The test harness, not gradwatch, sets this for the scenario and restores it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _nanogpt(
    s: Scenario,
    new_run: RunFactory | None,
    *,
    gradient_accumulation_steps: int,
    grad_clip: float,
    n_embd: int,
    batch_size: int,
    divide: bool = True,
    dtype: str = "float32",
    max_iters: int = 120,
    seed: int = 1337,
) -> None:
    k = gradient_accumulation_steps
    learning_rate, warmup_iters = 1e-3, 20
    torch.manual_seed(seed)
    data = _token_stream(seed, 20_000)
    batches = torch.Generator().manual_seed(seed)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK - 1, (batch_size,), generator=batches)
        x = torch.stack([data[i : i + BLOCK] for i in ix.tolist()])
        return x, torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix.tolist()])

    with _one_thread():
        model = TinyGPT(n_embd)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=learning_rate,
            betas=(0.9, 0.95),
        )
        scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
        autocast = (
            torch.autocast("cpu", dtype=torch.float16) if dtype == "float16" else contextlib.nullcontext()
        )
        trace = _Trace(s)
        config = {"gradient_accumulation_steps": k, "grad_clip": grad_clip, "dtype": dtype}
        with _gradwatch(
            new_run, s, model, optimizer, scaler if scaler.is_enabled() else None, **config
        ) as run:
            X, Y = get_batch()
            for it in range(max_iters):
                lr = _get_lr(it, learning_rate, warmup_iters, max_iters)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for _ in range(k):
                    with autocast:
                        loss = model(X, Y)
                        if divide:
                            loss = loss / k
                    X, Y = get_batch()
                    scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
                before = scaler.get_scale() if scaler.is_enabled() else None
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                lossf = loss.item() * k  # nanoGPT's logged loss
                if run is not None:
                    run.log({"loss": lossf})
                after = scaler.get_scale() if scaler.is_enabled() else None
                skipped = before is not None and after is not None and after < before
                trace.add(lossf, norm, lr, skipped=skipped, scale=after)
    ratios = [g / grad_clip for g in s.grad_norms if math.isfinite(g)]
    s.facts = {
        "median_norm_over_clip": round(statistics.median(ratios), 3),
        "clipped_fraction": round(sum(r > 1 for r in ratios) / len(ratios), 3),
        "loss_first_last": [round(s.losses[0], 3), round(s.losses[-1], 3)],
    }


def _healthy(name: str, new_run: RunFactory | None, **loop: object) -> Scenario:
    s = Scenario(name, None, None, precision="fp16" if loop.get("dtype") == "float16" else "fp32")
    _nanogpt(s, new_run, **loop)  # type: ignore[arg-type]
    ratio, clipped = s.facts["median_norm_over_clip"], s.facts["clipped_fraction"]
    _require(
        1.15 <= ratio <= 1.6 and clipped >= 0.9 and s.losses[-1] < s.losses[0],
        f"{name}: not nanoGPT's early training (clipped at 1.2-1.5x max_norm on >= 90% of steps, "
        f"learning): {s.facts}",
    )
    return s


@_timed
def nanogpt_accum8_clip1(new_run: RunFactory | None = None) -> Scenario:
    """nanoGPT as written: loss / 8 micro-batches, clip 1.0, fp32. Healthy."""
    return _healthy(
        "nanogpt_accum8_clip1", new_run, gradient_accumulation_steps=8, grad_clip=1.0, n_embd=64, batch_size=1
    )


@_timed
def nanogpt_accum4_clip1(new_run: RunFactory | None = None) -> Scenario:
    """loss / 4 micro-batches, clip 1.0, fp32. Healthy."""
    return _healthy(
        "nanogpt_accum4_clip1", new_run, gradient_accumulation_steps=4, grad_clip=1.0, n_embd=64, batch_size=2
    )


@_timed
def nanogpt_accum8_clip05(new_run: RunFactory | None = None) -> Scenario:
    """loss / 8 micro-batches, clip 0.5, fp32. Healthy."""
    return _healthy(
        "nanogpt_accum8_clip05",
        new_run,
        gradient_accumulation_steps=8,
        grad_clip=0.5,
        n_embd=32,
        batch_size=4,
    )


@_timed
def nanogpt_accum4_clip05_fp16(new_run: RunFactory | None = None) -> Scenario:
    """loss / 4 micro-batches, clip 0.5, fp16 autocast with nanoGPT's (enabled) GradScaler. Healthy."""
    return _healthy(
        "nanogpt_accum4_clip05_fp16",
        new_run,
        gradient_accumulation_steps=4,
        grad_clip=0.5,
        n_embd=32,
        batch_size=4,
        dtype="float16",
    )


@_timed
def nanogpt_undivided(new_run: RunFactory | None = None) -> Scenario:
    """nanoGPT with `loss = loss / gradient_accumulation_steps` left out (8 micro-batches, clip 1.0):
    the gradient is the sum of 8 micro-batches' and the clip cuts it ~8x on every step."""
    s = Scenario("nanogpt_undivided", "clip_saturation", None, cause="clip_saturation_accumulation")
    _nanogpt(s, new_run, gradient_accumulation_steps=8, grad_clip=1.0, n_embd=64, batch_size=1, divide=False)
    s.onset_step = 0
    _require(
        s.facts["median_norm_over_clip"] >= 6 and s.facts["clipped_fraction"] == 1.0,
        f"the undivided loss does not put the norm ~8x above the clip: {s.facts}",
    )
    return s
