"""Seeded CPU training scenarios that go wrong the way real jobs do, with their ground truth.

Each scenario is a function `scenario(new_run=None) -> Scenario`. It trains a tiny model for a few
hundred optimizer steps through a real mechanism (a scheduler bug, a corrupt record, a loop-order or
dtype mistake; never an inf written by hand) and measures with plain torch, independently of
gradwatch, what went wrong and from which step: `Scenario.pathology` (None for a healthy control),
`onset_step`, the affected parameter names, and per optimizer step the loss, the pre-clip global
gradient norm (unscaled), the learning rate, the skipped flag and the loss scale, so another tool
can be fed exactly the same values.

`new_run(name=..., config=...)` starts a gradwatch run (e.g. functools.partial(gradwatch.init,
project=..., server=url)); the scenario watches its model with it and logs the loss each step like a
user would, and finishes it. Steps are numbered like gradwatch's: the first optimizer step is 0 and
each optimizer step, skipped or not, advances by one.

`judging` reads the notifications a gradwatch server sent about a run (the generic JSON webhook
payload, per incident) and judges them against a scenario; tests/system/test_pathologies.py and
bench/diagnosis.py share it.

The package: `harness` (the Scenario record and the building blocks the scenarios train with),
`scenarios` (the catalogue: PATHOLOGIES, HEALTHY, SCENARIOS), `nanogpt` (karpathy/nanoGPT's loop, shrunk:
healthy clipping under accumulation and the undivided loss) and `judging`; every public name is
importable from `pathologies` itself.
"""

from .divergence import divergence_step
from .harness import RunFactory, Scenario, ScenarioError
from .judging import (
    DETECTION_WINDOW,
    FIRING_EVENTS,
    Notification,
    Verdict,
    as_notification,
    judge,
    names_layer,
    notifications,
    settled_notifications,
)
from .scenarios import (
    BENCH_ONLY,
    HEALTHY,
    PATHOLOGIES,
    SCENARIOS,
    LoRALinear,
    adapter_underflow,
    bf16_autocast,
    bf16_weights_stall,
    clip_before_unscale,
    decay_to_zero,
    fp16_calibration,
    fp16_default_sawtooth,
    grad_accum_no_divide,
    lr_jump,
    lr_too_high_fp32,
    lr_zero_scheduler,
    nan_loss_bad_sample,
    overflow_layer,
    post_ln_no_warmup,
    restart_schedule,
    resumed,
    stray_detach,
    warmup_cosine_restart,
    warmup_too_fast,
)

__all__ = [
    "BENCH_ONLY",
    "DETECTION_WINDOW",
    "FIRING_EVENTS",
    "HEALTHY",
    "PATHOLOGIES",
    "SCENARIOS",
    "LoRALinear",
    "Notification",
    "RunFactory",
    "Scenario",
    "ScenarioError",
    "Verdict",
    "adapter_underflow",
    "as_notification",
    "bf16_autocast",
    "bf16_weights_stall",
    "clip_before_unscale",
    "decay_to_zero",
    "divergence_step",
    "fp16_calibration",
    "fp16_default_sawtooth",
    "grad_accum_no_divide",
    "judge",
    "lr_jump",
    "lr_too_high_fp32",
    "lr_zero_scheduler",
    "names_layer",
    "nan_loss_bad_sample",
    "notifications",
    "overflow_layer",
    "post_ln_no_warmup",
    "restart_schedule",
    "resumed",
    "settled_notifications",
    "stray_detach",
    "warmup_cosine_restart",
    "warmup_too_fast",
]
