"""The scenario catalogue: the pathologies, each a seeded CPU training run that goes wrong through a real
mechanism, and the healthy controls (some of them look-alikes of pathologies; nanoGPT's loop is in
`nanogpt`);
each returns its `Scenario` with the ground truth it measured itself (see the package's docstring)."""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .divergence import lr_restart_100x, post_ln_no_warmup, warmup_too_fast
from .harness import (
    RunFactory,
    Scenario,
    _ChangeMeter,
    _finite,
    _first,
    _fp16_step,
    _fp32_step,
    _grad_norm,
    _gradwatch,
    _log,
    _lr,
    _mlp,
    _require,
    _Task,
    _timed,
    _Trace,
)
from .nanogpt import (
    nanogpt_accum4_clip05_fp16,
    nanogpt_accum4_clip1,
    nanogpt_accum8_clip05,
    nanogpt_accum8_clip1,
    nanogpt_undivided,
)

# -- pathologies ---------------------------------------------------------------------------------------


def restart_schedule(step: int, restart_at: int, factor: float = 1.0, warmup_steps: int = 0) -> float:
    """LambdaLR multiplier of a warm restart at `restart_at`: `factor` x the base lr, reached after
    `warmup_steps` of linear warmup."""
    if step < restart_at:
        return 1.0
    if warmup_steps and step - restart_at < warmup_steps:
        return factor * (step - restart_at + 1) / warmup_steps
    return factor


@_timed
def lr_jump(new_run: RunFactory | None = None) -> Scenario:
    """fp16 + GradScaler + AdamW at lr 1e-3; a warm restart at step 250 meant to warm up over 300 steps
    gets 300 as its *factor* (a positional-argument slip), so the lr jumps 300x and training diverges."""
    s = Scenario("lr_jump", "lr_jump", None, precision="fp16")
    trace, task, model = _Trace(s), _Task(1), _mlp(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: restart_schedule(step, 250, 300))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=100)
    with _gradwatch(new_run, s, model, optimizer, scaler, lr=1e-3) as run:
        for step in range(350):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp16_step(model, optimizer, scaler, loss, trace)
            scheduler.step()
    s.onset_step = _first([i > 0 and lr > 10 * s.lrs[i - 1] for i, lr in enumerate(s.lrs)])
    before = [g for g in s.grad_norms[200:250] if _finite(g)]
    after = s.grad_norms[s.onset_step : s.onset_step + 30] if s.onset_step is not None else []
    s.facts = {
        "lr_before": s.lrs[0],
        "lr_after": s.lrs[-1],
        "skips_after_onset": sum(s.skipped[250:]),
        "grad_norm_before_median": sorted(before)[len(before) // 2],
        "grad_norm_after_max": max((g for g in after if _finite(g)), default=math.inf),
    }
    _require(s.onset_step == 250, f"the lr jump is at step {s.onset_step}, expected 250")
    _require(
        s.facts["grad_norm_after_max"] > 10 * s.facts["grad_norm_before_median"]
        or s.facts["skips_after_onset"] > 5,
        f"no divergence after the lr jump: {s.facts}",
    )
    return s


@_timed
def clip_before_unscale(new_run: RunFactory | None = None) -> Scenario:
    """fp16 loop that calls clip_grad_norm_(1.0) BEFORE scaler.unscale_: the clip compares the scaled
    norm (S x ||g||) with 1.0, fires on every step and shrinks the true gradient to 1/S."""
    s = Scenario("clip_before_unscale", "clip_before_unscale", None, precision="fp16")
    trace, task, model = _Trace(s), _Task(2), _mlp(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=100)
    fired: list[bool] = []
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(250):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            norm = _grad_norm(model.parameters(), divide_by=scale)
            scaled_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the mistake: before unscale_
            scaler.unscale_(optimizer)
            lr = _lr(optimizer)
            scaler.step(optimizer)
            scaler.update()
            after = scaler.get_scale()
            trace.add(loss, norm, lr, skipped=after < scale, scale=after)
            fired.append(bool(torch.isfinite(scaled_norm)) and float(scaled_norm) > 1.0 and after >= scale)
    s.onset_step = _first(fired)
    s.facts = {
        "clip_fired_fraction": sum(fired) / len(fired),
        "median_true_norm": sorted(g for g in s.grad_norms if _finite(g))[len(s.grad_norms) // 2],
    }
    _require(
        s.onset_step is not None and s.facts["clip_fired_fraction"] > 0.9, f"clip did not fire: {s.facts}"
    )
    return s


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (alpha / r) * B @ A."""

    def __init__(self, features: int, rank: int, alpha: float, b_std: float) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, features) / features**0.5)
        self.lora_B = nn.Parameter(torch.randn(features, rank) * b_std)  # small, not zero: gradients flow
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class _Adapted(nn.Module):
    def __init__(self, features: int = 64, rank: int = 32) -> None:
        super().__init__()
        self.q = LoRALinear(features, rank, alpha=1.0, b_std=1e-3)
        self.v = LoRALinear(features, rank, alpha=1.0, b_std=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(torch.tanh(self.q(x)))


def _adapter_zero_fractions(model: nn.Module) -> dict[str, float]:
    return {
        n: (p.grad == 0).double().mean().item() for n, p in model.named_parameters() if p.grad is not None
    }


@_timed
def adapter_underflow(new_run: RunFactory | None = None) -> Scenario:
    """LoRA fine-tuning in fp16 autocast close to convergence (small alpha/r, small activations, a
    modest GradScaler(init_scale=2**8) with growth effectively off): most adapter gradient elements
    round to exactly 0 in the fp16 backward, while in fp32 none do."""
    s = Scenario("adapter_underflow", "adapter_underflow", None, precision="fp16")

    def build() -> tuple[_Adapted, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
        torch.manual_seed(3)
        model = _Adapted()
        correction = torch.randn(64, 64) * 1e-4 / 8  # the small change the fine-tune has to learn

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            generator = torch.Generator().manual_seed(3_000_000 + step)
            x = torch.randn(64, 64, generator=generator) * 0.01  # small activations (embeddings, std 0.01)
            with torch.no_grad():
                target = model(x) + x @ correction * 100 + 1e-4 * torch.randn(64, 64, generator=generator)
            return x, target

        return model, batch

    # fp32 reference: the same model and batches, a few steps, no autocast.
    reference, batch = build()
    reference_zeros = []
    for step in range(3):
        x, target = batch(step)
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), target).backward()
        reference_zeros.append(_adapter_zero_fractions(reference))

    trace = _Trace(s)
    model, batch = build()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1_000_000)
    zero_fractions: list[dict[str, float]] = []
    with _gradwatch(new_run, s, model, optimizer, scaler, lora_r=32, lora_alpha=1) as run:
        for step in range(200):
            x, target = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), target)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            zero_fractions.append(_adapter_zero_fractions(model))
            norm = _grad_norm(model.parameters())
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr, before = _lr(optimizer), scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            trace.add(loss, norm, lr, skipped=scaler.get_scale() < before, scale=scaler.get_scale())
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(sizes.values())

    def overall(fractions: dict[str, float]) -> float:
        return sum(fractions[n] * sizes[n] for n in fractions) / total

    s.onset_step = _first([overall(f) > 0.5 for f in zero_fractions])
    at_onset = zero_fractions[s.onset_step] if s.onset_step is not None else {}
    s.layers = sorted(n for n, f in at_onset.items() if f > 0.5)
    s.facts = {
        "zero_fraction_fp16": round(sum(overall(f) for f in zero_fractions) / len(zero_fractions), 3),
        "zero_fraction_fp32": round(max(overall(f) for f in reference_zeros), 3),
        "per_layer_fp16": {n: round(f, 3) for n, f in at_onset.items()},
    }
    _require(
        s.facts["zero_fraction_fp16"] > 0.5 and s.facts["zero_fraction_fp32"] < 0.01,
        f"adapter gradients do not underflow in fp16 only: {s.facts}",
    )
    return s


class _Records(torch.utils.data.Dataset):
    """Parsed records: feature 0 is a byte count the pipeline log-transforms (log1p would be right)."""

    def __init__(self, count: int, corrupt: int | None) -> None:
        generator = torch.Generator().manual_seed(4)
        self.raw = torch.rand(count, 16, generator=generator) * 1000 + 1
        self.raw[:, 0] = torch.randint(1, 10_000, (count,), generator=generator).float()
        if corrupt is not None:
            self.raw[corrupt, 0] = 0.0  # a broken record: empty payload, size 0
        self.teacher = torch.randn(16, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        features = torch.log(self.raw[index]) - 3.5  # log of 0 is -inf for the broken record
        label = (features.clamp(-10, 10) @ self.teacher).argmax()
        return features, label, index


@_timed
def nan_loss_bad_sample(new_run: RunFactory | None = None) -> Scenario:
    """A DataLoader over parsed records; one record is broken (size 0) and the preprocessing takes its
    log: -inf reaches the model at the step whose batch holds it, the loss is NaN there, the NaN
    gradients poison AdamW's state and every later loss is NaN too."""
    s = Scenario("nan_loss_bad_sample", "nan_loss", None)
    batch_size, bad_step = 16, 150

    def sampler(dataset: Any) -> torch.utils.data.RandomSampler:
        return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(44))

    corrupt = list(sampler(range(4096)))[bad_step * batch_size + 5]  # lands in the batch of step 150
    data = _Records(4096, corrupt)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler(data))
    trace, model = _Trace(s), _mlp(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch_steps: dict[int, int] = {}
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step, (x, y, ids) in enumerate(loader):
            if step == 200:
                break
            if run is not None and hasattr(run, "log_batch"):
                run.log_batch(ids.tolist())
            batch_steps.update(dict.fromkeys(ids.tolist(), step))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp32_step(model, optimizer, loss, trace)
    s.onset_step = _first([not _finite(loss) for loss in s.losses])
    s.facts = {
        "corrupt_sample": corrupt,
        "corrupt_sample_step": batch_steps.get(corrupt),
        "non_finite_losses": sum(not _finite(loss) for loss in s.losses),
    }
    _require(s.onset_step == bad_step == s.facts["corrupt_sample_step"], f"NaN onset is off: {s.facts}")
    return s


@_timed
def bf16_weights_stall(new_run: RunFactory | None = None) -> Scenario:
    """model.to(torch.bfloat16) with no fp32 master weights and AdamW at lr 5e-5: each update is below
    half a bf16 ulp of most weights (|w| ~ 0.05-0.2), rounds away, and the weights stop changing."""
    s = Scenario("bf16_weights_stall", "weights_not_changing", None, precision="bf16-weights")
    trace, task = _Trace(s), _Task(5)
    model = _mlp(5, (16, 64, 64, 4)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    meter = _ChangeMeter(model)
    unchanged: list[dict[str, float]] = []
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(200):
            x, y = task.batch(step)
            loss = nn.functional.cross_entropy(model(x.bfloat16()).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            meter.before()
            _fp32_step(model, optimizer, loss, trace)
            unchanged.append(meter.after())
    sizes = {n: p.numel() for n, p in meter.params}
    overall = [sum(u[n] * sizes[n] for n in u) / sum(sizes.values()) for u in unchanged]
    s.onset_step = _first([fraction > 0.5 for fraction in overall])
    s.layers = sorted(n for n, f in unchanged[s.onset_step or 0].items() if f > 0.5)
    s.facts = {"unchanged_fraction_mean": round(sum(overall) / len(overall), 3)}
    _require(s.onset_step == 0 and s.facts["unchanged_fraction_mean"] > 0.5, f"weights did change: {s.facts}")
    return s


class _EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x).detach()  # left over from debugging a feature visualisation
        return self.head(h)


@_timed
def stray_detach(new_run: RunFactory | None = None) -> Scenario:
    """A forward with a stray .detach() after the encoder: the encoder's layers never get a gradient
    (grad None) and only the head trains."""
    s = Scenario("stray_detach", "no_gradient", None)
    torch.manual_seed(6)
    trace, task, model = _Trace(s), _Task(6), _EncoderHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    no_grad: list[list[str]] = []
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(200):
            x, y = task.batch(step)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            loss.backward()
            no_grad.append([n for n, p in model.named_parameters() if p.grad is None])
            norm, lr = _grad_norm(model.parameters()), _lr(optimizer)
            optimizer.step()
            trace.add(loss, norm, lr)
    s.onset_step = _first([bool(names) for names in no_grad])
    s.layers = no_grad[0]
    _require(
        s.onset_step == 0 and all(n.startswith("encoder.") for n in s.layers) and len(s.layers) == 4,
        f"unexpected layers without gradient: {s.layers}",
    )
    return s


@_timed
def grad_accum_no_divide(new_run: RunFactory | None = None) -> Scenario:
    """fp16 gradient accumulation over 8 micro-batches that forgot loss / 8, with unscale_ then
    clip_grad_norm_(0.45): the gradient is 8x too large and the clip fires on every step, at ~4.4x
    max_norm over the first 20 steps and ~7x over the run (divided, it would clip on a quarter of the
    steps). An undivided loss whose norm is only 1.5-3x the clip (divided: 0.2-0.4x) is not told apart
    from healthy clipping: that evidence fits nanoGPT's divided loss as well (see the nanogpt module)."""
    s = Scenario("grad_accum_no_divide", "clip_saturation", None, precision="fp16")
    trace, task, model = _Trace(s), _Task(7, batch=8), _mlp(7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=100)
    accumulation, max_norm = 8, 0.45
    with _gradwatch(new_run, s, model, optimizer, scaler, accumulation=accumulation) as run:
        for step in range(100):
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for micro in range(accumulation):
                x, y = task.batch(step, micro)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)  # the mistake: no / accumulation
                scaler.scale(loss).backward()
                losses.append(loss.detach())
            mean_loss = torch.stack(losses).mean()
            _log(run, mean_loss)
            scaler.unscale_(optimizer)
            norm = _grad_norm(model.parameters())
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            lr, before = _lr(optimizer), scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            trace.add(mean_loss, norm, lr, skipped=scaler.get_scale() < before, scale=scaler.get_scale())
    clipped = [_finite(g) and g > max_norm for g in s.grad_norms]
    s.onset_step = _first(clipped)
    finite = [g for g in s.grad_norms if _finite(g)]
    s.facts = {
        "clipped_fraction": round(sum(clipped) / len(clipped), 3),
        "clipped_fraction_if_divided": round(
            sum(g / accumulation > max_norm for g in finite) / len(finite), 3
        ),
    }
    _require(
        s.facts["clipped_fraction"] > 0.9 and s.facts["clipped_fraction_if_divided"] < 0.5,
        f"the clip does not saturate only because of the missing division: {s.facts}",
    )
    return s


class _PretrainedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.block = nn.Linear(64, 64)  # loaded from a bf16 checkpoint with outlier channels
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = h + self.block(h)
        return self.head(nn.functional.layer_norm(h, (64,)))


def _bf16_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A bf16 'pretrained' state dict: the block has a few outlier output channels (|w| ~ 4000),
    as bf16-trained models do; their outputs exceed fp16's 65504, never bf16's range."""
    torch.manual_seed(seed)
    state = {k: v.to(torch.bfloat16) for k, v in _PretrainedBlock().state_dict().items()}
    outliers = torch.zeros(64, 64)
    outliers[:4] = 4000.0 * (torch.rand(4, 64) + 0.5)
    state["block.weight"] = (state["block.weight"].float() + outliers).to(torch.bfloat16)
    return state


@_timed
def overflow_layer(new_run: RunFactory | None = None) -> Scenario:
    """A bf16-pretrained model fine-tuned in fp16 autocast with a GradScaler: the block's activations
    overflow fp16 on every step, every step is skipped, the scale halves step after step (the
    scaler's calibration never ends) and the model never trains."""
    s = Scenario("overflow_layer", "fp16_overflow", None, precision="fp16")
    trace, task = _Trace(s), _Task(8)
    model = _PretrainedBlock()
    model.load_state_dict({k: v.float() for k, v in _bf16_checkpoint(8).items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    non_finite_modules: list[str] = []

    def spot(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if name not in non_finite_modules and not torch.isfinite(output).all():
                non_finite_modules.append(name)

        return hook

    handles = [m.register_forward_hook(spot(n)) for n, m in model.named_children()]
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(120):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp16_step(model, optimizer, scaler, loss, trace)
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        fp32_loss = nn.functional.cross_entropy(model(task.batch(0)[0]), task.batch(0)[1]).item()
    s.onset_step = _first(
        [skipped and not _finite(loss) for skipped, loss in zip(s.skipped, s.losses, strict=True)]
    )
    first = non_finite_modules[0] if non_finite_modules else ""
    s.layers = [n for n, _ in model.named_parameters() if n.startswith(f"{first}.")]
    s.facts = {
        "skipped_fraction": sum(s.skipped) / len(s.skipped),
        "final_scale": s.scales[-1],
        "first_overflowing_module": first,
        "fp32_loss": fp32_loss,
    }
    _require(
        s.onset_step == 0 and all(s.skipped) and first == "block" and _finite(fp32_loss),
        f"the overflow is not the block's in fp16 only: {s.facts}",
    )
    return s


def decay_to_zero(step: int, total_steps: int) -> float:
    """LambdaLR multiplier: linear decay from 1 to 0 at `total_steps`."""
    return max(0.0, 1.0 - step / total_steps)


@_timed
def lr_zero_scheduler(new_run: RunFactory | None = None) -> Scenario:
    """A linear decay meant to end after 3 epochs of 100 steps is given steps_per_epoch as its total:
    the lr reaches 0 at step 100 and the weights stop changing for the remaining 200 steps."""
    s = Scenario("lr_zero_scheduler", "lr_zero", None)
    trace, task, model = _Trace(s), _Task(9), _mlp(9)
    epochs, steps_per_epoch = 3, 100
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: decay_to_zero(step, steps_per_epoch)
    )  # the mistake: not epochs * steps_per_epoch
    meter = _ChangeMeter(model)
    unchanged: list[bool] = []
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(epochs * steps_per_epoch):
            x, y = task.batch(step)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            meter.before()
            _fp32_step(model, optimizer, loss, trace)
            unchanged.append(min(meter.after().values()) == 1.0)
            scheduler.step()
    s.onset_step = _first(unchanged)
    s.layers = []
    s.facts = {"first_zero_lr_step": _first([lr == 0.0 for lr in s.lrs]), "unchanged_steps": sum(unchanged)}
    _require(
        s.onset_step == s.facts["first_zero_lr_step"] == steps_per_epoch, f"stall onset is off: {s.facts}"
    )
    return s


@_timed
def lr_too_high_fp32(new_run: RunFactory | None = None) -> Scenario:
    """fp32 regression with SGD + momentum whose linear warmup climbs to a peak lr 10x too high (0.5, a
    config meant 0.05): once the lr passes the stability limit the loss climbs for good and the
    gradient norm grows >1000x within 100 steps. Onset: the first step from which the loss stays above
    twice its median of the 50 steps before (the climb is gradual: 1.5x would say step 123, 3x 171)."""
    s = Scenario("lr_too_high_fp32", "grad_norm_growth", None)
    trace, task, model = _Trace(s), _Task(10), _mlp(10, (16, 32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.002, total_iters=300)
    with _gradwatch(new_run, s, model, optimizer, peak_lr=0.5) as run:
        for step in range(300):
            x, _ = task.batch(step)
            loss = nn.functional.mse_loss(model(x), x @ task.teacher)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp32_step(model, optimizer, loss, trace, clip=None)
            scheduler.step()
            if len(s.losses) > 20 and not any(_finite(x) for x in s.losses[-20:]):
                break  # diverged for good: the job would have been killed here
    s.onset_step = _divergence_onset(s.losses)
    s.precursors_from = _divergence_onset(s.losses, factor=1.5)  # the climb shows (step 123)
    onset = s.onset_step or 0
    baseline = sorted(s.grad_norms[:20])[10]
    window = s.grad_norms[onset : onset + 100]
    s.facts = {
        "baseline_grad_norm": round(baseline, 4),
        "lr_at_onset": s.lrs[onset],
        "max_growth_in_100_steps": max((g for g in window if _finite(g)), default=math.inf) / baseline,
    }
    _require(
        s.onset_step is not None and s.facts["max_growth_in_100_steps"] > 1000, f"no explosion: {s.facts}"
    )
    return s


def _divergence_onset(losses: list[float], before: int = 50, factor: float = 2.0) -> int | None:
    """The first step from which the loss never again falls below `factor` x the median loss of the
    `before` steps preceding it (a non-finite loss counts as above): where a divergence starts."""
    for t in range(before, len(losses)):
        previous = sorted(x for x in losses[t - before : t] if _finite(x))
        if previous and all(not _finite(x) or x > factor * previous[len(previous) // 2] for x in losses[t:]):
            return t
    return None


class _Classifier(nn.Module):
    """An encoder (two hidden layers) and a head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _left_unchanged(model: nn.Module, start: dict[str, torch.Tensor]) -> list[str]:
    """Parameters that have a gradient now and are bit-identical to `start`."""
    return [
        n for n, p in model.named_parameters() if p.grad is not None and torch.equal(p.detach(), start[n])
    ]


def _train_classifier(
    s: Scenario,
    new_run: RunFactory | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    seed: int,
    before_step: Callable[[int], None] | None = None,
) -> list[list[str]]:
    """fp32 AdamW training of a _Classifier; per step, the parameters that had a gradient and did not
    change (measured with plain torch)."""
    trace, task = _Trace(s), _Task(seed)
    frozen_by_mistake: list[list[str]] = []
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            x, y = task.batch(step)
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad(set_to_none=True)
            _log(run, loss)
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            _fp32_step(model, optimizer, loss, trace)
            frozen_by_mistake.append(_left_unchanged(model, start))
    return frozen_by_mistake


def _weight_share(model: nn.Module, names: list[str]) -> float:
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return sum(sizes[n] for n in names) / sum(sizes.values())


@_timed
def optimizer_subset(new_run: RunFactory | None = None) -> Scenario:
    """The optimizer is built from the head's parameters only (AdamW(model.head.parameters())): the
    encoder's layers get a gradient on every step and never change; 94% of the weights are frozen by
    mistake and the loss plateaus higher, with nothing skipped or non-finite."""
    s = Scenario("optimizer_subset", "params_not_in_optimizer", None, cause="params_not_in_optimizer")
    model = _Classifier(16)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-3)  # the mistake: model.parameters()
    unchanged = _train_classifier(s, new_run, model, optimizer, 200, 16)
    s.onset_step = _first([bool(names) for names in unchanged])
    s.layers = unchanged[0]
    s.facts = {"frozen_by_mistake_share": round(_weight_share(model, s.layers), 3)}
    _require(
        s.onset_step == 0
        and all(names == s.layers for names in unchanged)
        and sorted(s.layers) == sorted(n for n, _ in model.encoder.named_parameters(prefix="encoder")),
        f"not the encoder alone left unchanged: {s.layers}",
    )
    return s


@_timed
def unfrozen_after_optimizer(new_run: RunFactory | None = None) -> Scenario:
    """Two-stage fine-tuning: the encoder starts frozen and the optimizer is built from the trainable
    parameters (the head); at step 100 the encoder is unfrozen (requires_grad_(True)) but the optimizer
    is not rebuilt, so from then on the encoder gets gradients and never changes."""
    s = Scenario("unfrozen_after_optimizer", "params_not_in_optimizer", None, cause="params_not_in_optimizer")
    model = _Classifier(17)
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def unfreeze(step: int) -> None:
        if step == 100:
            model.encoder.requires_grad_(True)  # the mistake: no new optimizer / add_param_group

    unchanged = _train_classifier(s, new_run, model, optimizer, 160, 17, before_step=unfreeze)
    s.onset_step = _first([bool(names) for names in unchanged])
    s.layers = unchanged[s.onset_step or 0]
    s.facts = {"frozen_by_mistake_share": round(_weight_share(model, s.layers), 3)}
    _require(
        s.onset_step == 100 and len(s.layers) == 4 and all(n.startswith("encoder.") for n in s.layers),
        f"the unfrozen encoder is not what stays unchanged: {s.onset_step}, {s.layers}",
    )
    return s


class _TokenModel(nn.Module):
    """Token embedding, LayerNorm, two hidden layers and an output layer, initialised as GPT-2 is
    (weights N(0, 0.02), biases and the LayerNorm shift zero)."""

    def __init__(self, seed: int, vocabulary: int = 64, width: int = 32, context: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocabulary, width)
        self.norm = nn.LayerNorm(width * context)
        self.hidden = nn.Linear(width * context, 64)
        self.mix = nn.Linear(64, 64)
        self.out = nn.Linear(64, vocabulary)
        for module in (self.embed, self.hidden, self.mix, self.out):
            nn.init.normal_(module.weight, std=0.02)
        for module in (self.hidden, self.mix, self.out):
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens).flatten(1))
        return self.out(torch.relu(self.mix(torch.relu(self.hidden(h)))))


def _token_batch(seed: int, step: int, vocabulary: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocabulary, (32, 8), generator=generator)
    return tokens, tokens[:, 0] % 8  # the class of the first token


def _train_tokens(
    s: Scenario,
    new_run: RunFactory | None,
    model: _TokenModel,
    optimizer: torch.optim.Optimizer,
    steps: int,
    seed: int,
    scheduler: Any = None,
    extra_optimizer: torch.optim.Optimizer | None = None,
) -> list[dict[str, float]]:
    """fp32 training of a _TokenModel; the update ratio ||dW|| / ||W|| of every parameter at each step
    (plain torch)."""
    trace = _Trace(s)
    vocabulary = model.embed.num_embeddings
    ratios: list[dict[str, float]] = []
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(steps):
            tokens, y = _token_batch(seed, step, vocabulary)
            loss = nn.functional.cross_entropy(model(tokens), y)
            model.zero_grad(set_to_none=True)
            _log(run, loss)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            if extra_optimizer is not None:
                loss.backward()
                norm, lr = _grad_norm(model.parameters()), _lr(optimizer)
                extra_optimizer.step()
                optimizer.step()
                trace.add(loss, norm, lr)
            else:
                _fp32_step(model, optimizer, loss, trace, clip=None)
            ratios.append(
                {
                    n: ((p.detach() - before[n]).norm() / before[n].norm()).item()
                    for n, p in model.named_parameters()
                }
            )
            if scheduler is not None:
                scheduler.step()
    return ratios


def _median_weight_ratio(ratios: dict[str, float], but: str) -> float:
    values = sorted(v for n, v in ratios.items() if n.endswith("weight") and n != but and n != "norm.weight")
    return values[(len(values) - 1) // 2]


@_timed
def embedding_lr_typo(new_run: RunFactory | None = None) -> Scenario:
    """AdamW with a param group for the embedding whose lr is 1e-1 where 1e-3 was meant (a typo): its
    update ratio at the first step is ~100x the median layer's; the weights blow up to ~5x their init
    scale in one step and the ratio evens out within a few dozen steps while the lr stays wrong."""
    s = Scenario("embedding_lr_typo", "update_ratio_outlier", None, cause="update_ratio_outlier")
    model = _TokenModel(18)
    rest = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": 1e-3}, {"params": [model.embed.weight], "lr": 1e-1}]  # the typo: 1e-1
    )
    ratios = _train_tokens(s, new_run, model, optimizer, 200, 18)
    factors = [r["embed.weight"] / _median_weight_ratio(r, "embed.weight") for r in ratios]
    s.onset_step = _first([f >= 30 for f in factors])
    s.layers = ["embed.weight"]
    s.facts = {"ratio_factor_step0": round(factors[0], 1), "ratio_factor_step20": round(factors[20], 1)}
    _require(
        s.onset_step == 0 and factors[0] > 50, f"the embedding's update ratio is not an outlier: {s.facts}"
    )
    return s


# -- healthy controls ----------------------------------------------------------------------------------


@_timed
def transient_overflow_burst(new_run: RunFactory | None = None) -> Scenario:
    """fp16 with a GradScaler; for six steps (150-155) the inputs arrive 1e5 times too large (a corrupt
    shard, the demo's injected blow-up): activations overflow fp16, the losses are inf, the scaler skips
    those steps and backs off; then the data is clean again and training carries on as before. A burst
    that passed: notified when it happens, then updated once every rule that fired has cleared."""
    s = Scenario(
        "transient_overflow_burst", "transient_burst", None, cause="transient_burst", precision="fp16"
    )
    trace, task, model = _Trace(s), _Task(31), _mlp(31)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(320):
            x, y = task.batch(step)
            if 150 <= step < 156:
                x = x * 1e5
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp16_step(model, optimizer, scaler, loss, trace)
    bad = [step for step, loss in enumerate(s.losses) if not _finite(loss)]
    s.onset_step = bad[0] if bad else None
    early, late = sum(s.losses[:20]) / 20, sum(s.losses[-20:]) / 20
    s.facts = {"non_finite_steps": bad, "skips_after_200": sum(s.skipped[200:]), "loss": (early, late)}
    _require(
        bool(bad)
        and bad[0] == 150
        and bad[-1] <= 155
        and s.facts["skips_after_200"] <= 2
        and late < 0.8 * early,
        f"not a burst that passed: {s.facts}",
    )
    return s


@_timed
def lr_warmup_too_high(new_run: RunFactory | None = None) -> Scenario:
    """fp16, SGD with momentum and a warm-up that multiplies the lr 2.5x a step to a peak of 50, far
    too high: the loss climbs from 1.4 to ~30 as the lr passes ~10, then goes NaN for good. No one
    step's rise is a jump; the ramp is the cause, not the data or fp16's range."""
    s = Scenario("lr_warmup_too_high", "lr_ramp", None, cause="lr_ramp", precision="fp16")
    trace, task, model = _Trace(s), _Task(21), _mlp(21)
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, 1e-4 * 1e4 ** (step / 10)))
    scaler = torch.amp.GradScaler("cpu")
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(60):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp16_step(model, optimizer, scaler, loss, trace, clip=None)
            schedule.step()
    s.onset_step = _divergence_onset(s.losses, before=5)
    s.facts = {"first_nan": _first([not _finite(loss) for loss in s.losses]), "peak_lr": max(s.lrs)}
    _require(
        s.onset_step is not None and s.facts["first_nan"] is not None and s.facts["peak_lr"] == 50.0,
        f"the warm-up did not break the run: {s.facts}",
    )
    return s


@_timed
def no_zero_grad(new_run: RunFactory | None = None) -> Scenario:
    """fp16 with a GradScaler (growth_interval=10) and a loop that never calls optimizer.zero_grad():
    the gradients accumulate until a growth of the scale overflows, that inf stays in .grad for ever,
    every later step is skipped and the scale halves through 1 towards 0."""
    s = Scenario("no_zero_grad", "grads_never_cleared", None, cause="overflow_at_any_scale", precision="fp16")
    trace, task, model = _Trace(s), _Task(41), _mlp(41)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10)
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(150):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            _log(run, loss)  # no optimizer.zero_grad() anywhere in the loop
            _fp16_step(model, optimizer, scaler, loss, trace, clip=None)
    first_skip = _first(s.skipped)
    s.onset_step = first_skip
    s.facts = {"first_skip": first_skip, "final_scale": s.scales[-1]}
    _require(
        first_skip is not None and all(s.skipped[first_skip:]) and (s.scales[-1] or 1.0) < 1.0,
        f"the stale inf did not stay: {s.facts}",
    )
    return s


def _healthy_fp16(s: Scenario, new_run: RunFactory | None, seed: int, steps: int, **scaler_args: Any) -> None:
    trace, task, model = _Trace(s), _Task(seed), _mlp(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **scaler_args)
    with _gradwatch(new_run, s, model, optimizer, scaler) as run:
        for step in range(steps):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp16_step(model, optimizer, scaler, loss, trace)


def _calibration_length(skipped: list[bool]) -> int:
    return next((i for i, flag in enumerate(skipped) if not flag), len(skipped))


def _learned(s: Scenario) -> bool:
    finite = [loss for loss in s.losses if _finite(loss)]
    return len(finite) == len(s.losses) and sum(finite[-20:]) / 20 < 0.8 * sum(finite[:20]) / 20


@_timed
def fp16_calibration(new_run: RunFactory | None = None) -> Scenario:
    """GradScaler(init_scale=2**32), as Megatron starts: it backs off for its first steps, then trains."""
    s = Scenario("fp16_calibration", None, None, precision="fp16")
    _healthy_fp16(s, new_run, 11, 300, init_scale=2.0**32)
    calibration = _calibration_length(s.skipped)
    s.facts = {"calibration_skips": calibration, "later_skips": sum(s.skipped[calibration:])}
    _require(
        calibration >= 8 and s.facts["later_skips"] <= 2 and _learned(s),
        f"not a clean calibration: {s.facts}",
    )
    return s


@_timed
def fp16_default_sawtooth(new_run: RunFactory | None = None) -> Scenario:
    """Dynamic loss scaling over several growth intervals (growth_interval=50): the scale grows until a
    step overflows, backs off once, grows again; isolated skips, a sawtooth."""
    s = Scenario("fp16_default_sawtooth", None, None, precision="fp16")
    _healthy_fp16(s, new_run, 12, 400, init_scale=2.0**18, growth_interval=50)
    skips = [i for i, flag in enumerate(s.skipped) if flag]
    s.facts = {"skip_steps": skips, "max_scale": max(x for x in s.scales if x is not None)}
    isolated = all(b - a > 10 for a, b in itertools.pairwise(skips))
    _require(len(skips) >= 3 and isolated and _learned(s), f"no sawtooth: {s.facts}")
    return s


@_timed
def bf16_autocast(new_run: RunFactory | None = None) -> Scenario:
    """bf16 autocast, fp32 weights, no scaler: what a healthy bf16 run looks like."""
    s = Scenario("bf16_autocast", None, None, precision="bf16")
    trace, task, model = _Trace(s), _Task(13), _mlp(13)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(300):
            x, y = task.batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp32_step(model, optimizer, loss, trace)
    _require(_learned(s), "bf16 run did not learn")
    return s


@_timed
def warmup_cosine_restart(new_run: RunFactory | None = None) -> Scenario:
    """Linear warmup (50 steps) then cosine annealing with warm restarts every 150 steps: each restart
    raises the lr from ~0 back to its peak and the loss a little; healthy."""
    s = Scenario("warmup_cosine_restart", None, None)
    trace, task, model = _Trace(s), _Task(14), _mlp(14)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=50),
            torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=150, eta_min=1e-5),
        ],
        milestones=[50],
    )
    with _gradwatch(new_run, s, model, optimizer) as run:
        for step in range(400):
            x, y = task.batch(step)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            _log(run, loss)
            _fp32_step(model, optimizer, loss, trace)
            scheduler.step()
    restarts = [i for i in range(1, len(s.lrs)) if s.lrs[i] > 5 * s.lrs[i - 1] and i > 50]
    s.facts = {"restart_steps": restarts, "peak_lr": max(s.lrs)}
    _require(len(restarts) == 2 and _learned(s), f"unexpected schedule: {s.facts}")
    return s


@_timed
def resumed(new_run: RunFactory | None = None) -> Scenario:
    """fp16 training for 200 steps, a checkpoint (model, optimizer, scaler state, run id, step), then a
    second gradwatch.init(run_id=<same id>) in the same process continuing at step 200 for 200 more."""
    s = Scenario("resumed", None, None, precision="fp16")
    trace, task = _Trace(s), _Task(15)
    checkpoint = io.BytesIO()

    def segment(start: int, stop: int, restore: dict[str, Any] | None) -> None:
        model = _mlp(15)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=100)
        run_id = None
        if restore is not None:
            model.load_state_dict(restore["model"])
            optimizer.load_state_dict(restore["optimizer"])
            scaler.load_state_dict(restore["scaler"])
            run_id = restore["run_id"]
        with _gradwatch(new_run, s, model, optimizer, scaler, run_id=run_id, start_step=start) as run:
            for step in range(start, stop):
                x, y = task.batch(step)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                optimizer.zero_grad(set_to_none=True)
                _log(run, loss)
                _fp16_step(model, optimizer, scaler, loss, trace)
            if restore is None:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(),
                        "run_id": run.id if run else None,
                        "step": stop,
                    },
                    checkpoint,
                )

    segment(0, 200, None)
    checkpoint.seek(0)
    state = torch.load(checkpoint, weights_only=False)
    segment(state["step"], 400, state)
    s.facts = {"skips": sum(s.skipped), "scale_at_resume": s.scales[199]}
    _require(trace.step == 400 and _learned(s) and sum(s.skipped[200:]) <= 2, f"resume went wrong: {s.facts}")
    _require(len(set(s.run_ids)) <= 1, f"the resume started a new run: {s.run_ids}")
    return s


@_timed
def frozen_backbone(new_run: RunFactory | None = None) -> Scenario:
    """Linear probing: the encoder frozen on purpose (requires_grad_(False)), the optimizer over the
    head; the encoder gets no gradient at all. Healthy."""
    s = Scenario("frozen_backbone", None, None)
    model = _Classifier(19)
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    unchanged = _train_classifier(s, new_run, model, optimizer, 200, 19)
    _require(
        not any(unchanged) and sum(s.losses[-20:]) < sum(s.losses[:20]),
        f"not a clean linear probe: {s.losses}",
    )
    return s


@_timed
def token_model_warmup(new_run: RunFactory | None = None) -> Scenario:
    """A GPT-2-initialised token model (zero biases and LayerNorm shift, embedding rows only partly used
    per batch: 512 tokens, 256 per step), AdamW with one lr and a linear warm-up. The zero-initialised
    biases' update ratios are infinite at the first step and large for a while: healthy."""
    s = Scenario("token_model_warmup", None, None)
    model = _TokenModel(20, vocabulary=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=30)
    ratios = _train_tokens(s, new_run, model, optimizer, 300, 20, scheduler=scheduler)
    s.facts = {
        "bias_ratio_step1": round(ratios[1]["hidden.bias"], 3),
        "embed_ratio_step0": ratios[0]["embed.weight"],
    }
    _require(math.isinf(ratios[0]["hidden.bias"]) and _learned(s), f"unexpected run: {s.facts}")
    return s


@_timed
def sparse_embedding_two_optimizers(new_run: RunFactory | None = None) -> Scenario:
    """A sparse embedding (nn.Embedding(sparse=True)) stepped by its own SparseAdam, the rest by the
    AdamW that gradwatch watches: the embedding is in no param group of the watched optimizer yet
    changes every step. Healthy."""
    s = Scenario("sparse_embedding_two_optimizers", None, None)
    model = _TokenModel(21)
    model.embed = nn.Embedding(64, 32, sparse=True)
    nn.init.normal_(model.embed.weight, std=0.02)
    sparse = torch.optim.SparseAdam([model.embed.weight], lr=3e-3)
    dense = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("embed.")], lr=3e-3)
    ratios = _train_tokens(s, new_run, model, dense, 200, 21, extra_optimizer=sparse)
    _require(all(r["embed.weight"] > 0 for r in ratios) and _learned(s), "the embedding did not train")
    return s


@_timed
def lora_finetune(new_run: RunFactory | None = None) -> Scenario:
    """A LoRA fine-tune in fp32 as PEFT sets it up: frozen base weights (no gradient), adapters with A
    random and B zero-initialised (B's update ratio is infinite at the first step, then large while it
    grows from zero). Healthy."""
    s = Scenario("lora_finetune", None, None)
    torch.manual_seed(22)
    model = nn.Sequential(
        LoRALinear(16, 4, alpha=8.0, b_std=0.0), nn.ReLU(), LoRALinear(16, 4, alpha=8.0, b_std=0.0), nn.ReLU()
    )
    head = nn.Linear(16, 4)
    head.requires_grad_(False)
    full = nn.Sequential(model, head)
    optimizer = torch.optim.AdamW([p for p in full.parameters() if p.requires_grad], lr=3e-3)
    unchanged = _train_classifier(s, new_run, full, optimizer, 200, 22)
    _require(not any(unchanged) and _learned(s), f"the adapters did not all train: {unchanged[:1]}")
    return s


PATHOLOGIES: tuple[Callable[..., Scenario], ...] = (
    lr_jump,
    clip_before_unscale,
    adapter_underflow,
    nan_loss_bad_sample,
    bf16_weights_stall,
    stray_detach,
    grad_accum_no_divide,
    overflow_layer,
    lr_zero_scheduler,
    lr_too_high_fp32,
    optimizer_subset,
    unfrozen_after_optimizer,
    embedding_lr_typo,
    transient_overflow_burst,
    lr_warmup_too_high,
    no_zero_grad,
    nanogpt_undivided,
    lr_restart_100x,
)
HEALTHY: tuple[Callable[..., Scenario], ...] = (
    fp16_calibration,
    fp16_default_sawtooth,
    bf16_autocast,
    warmup_cosine_restart,
    resumed,
    frozen_backbone,
    token_model_warmup,
    sparse_embedding_two_optimizers,
    lora_finetune,
    nanogpt_accum8_clip1,
    nanogpt_accum4_clip1,
    nanogpt_accum8_clip05,
    nanogpt_accum4_clip05_fp16,
)
SCENARIOS: dict[str, Callable[..., Scenario]] = {f.__name__: f for f in PATHOLOGIES + HEALTHY}
# Runs whose divergence step depends on float rounding (not pinnable in CI): measured by the benches.
BENCH_ONLY: dict[str, Callable[..., Scenario]] = {f.__name__: f for f in (post_ln_no_warmup, warmup_too_fast)}
