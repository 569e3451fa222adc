"""What a Watcher observes once, when watching starts (not on the step's path: a host read is fine).

- The fp16 setup of a run with a GradScaler: a model trained or stored in bfloat16 (the misuse
  bf16_model_in_fp16), and each layer's largest |weight| (param/max_abs, and their maximum for
  _derive, which tells weights_exceed_fp16 on the sender thread once the value has arrived).
- The order of the watched parameters: the model's, whatever order the optimizer lists them in.
- A distributed rank's "rank" event: who this rank is and how its gradients are laid out (the server
  reads it to list a run's ranks and to combine their values).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _distributed
from ._derive import MAX_ABS_WEIGHT
from ._errors import GradwatchWarning

if TYPE_CHECKING:
    from ._sink import StepSink


def check_fp16_setup(
    sink: StepSink,
    model: Any,
    params: list[Any],
    local_params: list[Any],
    like: Any,
    report_misuse: Callable[..., None],
) -> None:
    """Checks for a run whose loss an fp16 GradScaler scales: `params` are the watched parameters,
    `local_params` their local shards, `like` a tensor on the device the maxima are gathered on;
    report_misuse(kind, hint, **evidence) reports a misuse once."""
    import torch

    config_dtype = getattr(getattr(model, "config", None), "torch_dtype", None)
    bf16_params = any(p.dtype == torch.bfloat16 for p in params)
    if bf16_params or config_dtype in (torch.bfloat16, "bfloat16"):
        report_misuse(
            "bf16_model_in_fp16",
            "this model was trained/stored in bfloat16 and is now trained with an fp16 GradScaler: "
            "its weights and activations can exceed fp16's range (65504) and overflow every step. "
            "Train it in bf16 (torch.autocast(dtype=torch.bfloat16), no GradScaler).",
            config_dtype=str(config_dtype),
            bf16_parameters=bf16_params,
        )
    if any(p.numel() for p in local_params):
        # Checked on the sender thread once the value has arrived: no device sync here. The per-layer
        # maxima (param/max_abs, once) let the server name the layer likely to overflow fp16.
        with torch.no_grad():
            zero = torch.zeros((), dtype=torch.float32, device=like.device)
            per_layer = torch.stack(
                [
                    p.detach().abs().amax().float().to(zero.device, non_blocking=True) if p.numel() else zero
                    for p in local_params
                ]
            )
        sink.add_tensor("param/max_abs", sink.step, per_layer)
        sink.add_scalar(MAX_ABS_WEIGHT, sink.step, per_layer.amax())


def report_rank(sink: StepSink, parallelism: str, gradients: str, histograms: bool) -> None:
    """A distributed run's "rank" event (nothing for one process): this rank, its host and process,
    the job's `parallelism`, the `gradients` layout and whether this rank takes histograms. Warns
    when the run's rank is not torch.distributed's (several ranks would write over each other)."""
    identity = _distributed.process_identity()
    if identity.source == "torch.distributed" and identity.rank != sink.rank:
        warnings.warn(
            f"gradwatch: this run reports as rank {sink.rank} but torch.distributed says rank "
            f"{identity.rank}: call gradwatch.init() after init_process_group() (or set RANK), or "
            "several ranks will write over each other's data",
            GradwatchWarning,
            stacklevel=4,
        )
    started_as = sink.identity
    world_size = max(identity.world_size, started_as.world_size)
    if world_size <= 1:
        return
    sink.report_rank_at_finish()
    sink.add_event(
        sink.step,
        "rank",
        {
            "rank": sink.rank,
            "world_size": world_size,
            "local_rank": started_as.local_rank if started_as.local_rank is not None else identity.local_rank,
            "host": identity.host,
            "pid": os.getpid(),
            "parallelism": parallelism,
            "gradients": gradients,
            "histograms": histograms,
        },
    )


def in_model_order(model_params: list[Any], trainable: list[Any]) -> list[Any]:
    """The trainable parameters the optimizer holds, in the model's order (its param groups may list
    them otherwise: a decay / no-decay split); any the model does not name follow, in the groups'
    order. Each once, however often it is listed."""
    wanted = {id(p): p for p in trainable}
    ordered: dict[int, Any] = {}
    for p in [*model_params, *trainable]:
        if id(p) in wanted:
            ordered.setdefault(id(p), p)
    return list(ordered.values())
