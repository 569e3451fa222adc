"""The demo: a small transformer language model trained on CPU in float16 with a real GradScaler.

A planned disturbance makes the loss scale really drop: for a few steps the embeddings are blown up
so the fp16 forward/backward overflows, the GradScaler finds inf gradients, skips those optimizer
steps and halves its scale each time; the server groups what its rules find into one incident (the
run page's verdict). Everything is recorded through the public agent API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

VOCAB = 256


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 32
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    overflow_at: int = 150  # first step of the injected overflow burst
    overflow_steps: int = 4  # how many consecutive steps overflow (scale drops 2**overflow_steps x)
    seed: int = 0
    step_delay: float = 0.0  # seconds to sleep per step, to watch the charts move
    # --diverge: from this step a warm restart ramps the lr over 50 steps to a peak 100x too high (instead
    # of the overflow burst); the guard stops the run on the critical incident
    diverge_at: int | None = None


def demo_lr(cfg: DemoConfig, step: int) -> float:
    """The demo's learning rate: constant, or with --diverge a restart to a mistyped peak (100x)."""
    if cfg.diverge_at is None or step < cfg.diverge_at:
        return cfg.lr
    return cfg.lr * min(100.0, 1 + 99 * (step - cfg.diverge_at + 1) / 50)


def build_model(cfg: DemoConfig) -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, cfg.d_model)
            self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
            layer = nn.TransformerEncoderLayer(
                cfg.d_model, cfg.heads, 4 * cfg.d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
            self.head = nn.Linear(cfg.d_model, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq_len))
            self.blowup = 1.0  # set by the demo to inject an overflow

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = (self.embed(tokens) + self.pos) * self.blowup
            logits: torch.Tensor = self.head(self.blocks(x, mask=self.mask, is_causal=True))
            return logits

    return TinyLM()


def synthetic_batch(cfg: DemoConfig, generator: Any) -> Any:
    """Token sequences following x[t+1] = (5 x[t] + 3) mod VOCAB, with 1 token in 8 replaced by noise:
    learnable, so the loss falls, but not to zero."""
    import torch

    start = torch.randint(0, VOCAB, (cfg.batch_size, 1), generator=generator)
    seq = [start]
    for _ in range(cfg.seq_len):
        seq.append((seq[-1] * 5 + 3) % VOCAB)
    tokens = torch.cat(seq, dim=1)
    noise = torch.randint(0, VOCAB, tokens.shape, generator=generator)
    replace = torch.rand(tokens.shape, generator=generator) < 0.125
    return torch.where(replace, noise, tokens)


def train(run: Any, cfg: DemoConfig, log: Any = print) -> None:
    """Train the demo model for cfg.steps optimizer steps, watched by `run`."""
    import torch

    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler("cpu", growth_interval=100)
    diverging = cfg.diverge_at is not None
    run.watch(model, optimizer, scaler=scaler, guard=diverging)  # the guard only when asked to diverge
    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.perf_counter()
    for step in range(cfg.steps):
        if run.should_stop:  # the guard stopped training on a critical incident: say where to rewind to
            incident = run.guard.stopped_by or {}
            log(
                f"step {step:5d}  the guard stopped training: {incident.get('title')}; rewind to a "
                f"checkpoint at or before step {incident.get('last_healthy_step')} ({incident.get('link')})"
            )
            break
        for group in optimizer.param_groups:
            group["lr"] = demo_lr(cfg, step)
        tokens = synthetic_batch(cfg, generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        burst = not diverging and cfg.overflow_at <= step < cfg.overflow_at + cfg.overflow_steps
        model.blowup = 1e4 if burst else 1.0
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(inputs)
        loss = loss_fn(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.log({"loss": loss})
        run.log_batch(range(step * cfg.batch_size, (step + 1) * cfg.batch_size))  # the batch's sample ids
        scaler.step(optimizer)
        scaler.update()
        if step % 50 == 0 or step == cfg.steps - 1:
            # The demo's own progress line, as a user's loop would print it (a sync every 50 steps,
            # in user code: gradwatch itself never reads device values on the training thread).
            log(f"step {step:5d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}")
        if cfg.step_delay:
            time.sleep(cfg.step_delay)
    log(f"trained {run.step} steps in {time.perf_counter() - started:.1f} s")
