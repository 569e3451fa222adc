"""Hugging Face Trainer integration.

    from gradwatch.integrations.huggingface import GradwatchCallback
    trainer = Trainer(..., callbacks=[GradwatchCallback(project="llm", name="qlora-7b")])

Watches the model and the Trainer's optimizer (and Accelerate's GradScaler under fp16) from
on_train_begin, forwards the Trainer's logs as hf/* (loss, learning_rate, grad_norm…) at the step
they describe, the last one done, the loss also as `loss` (the Trainer's mean over its logging
window: what the loss charts and alerts read), and finishes the run at the end of training. Pass
run= to use a run you created yourself (it is then not finished here). With
watch_options={"guard": gradwatch.Guard(...)} (or True), a step after which the guard stopped training
sets the Trainer's control.should_training_stop: the Trainer ends as after its last step (it saves and
logs as configured).
"""

from __future__ import annotations

import numbers
from typing import Any

from transformers import TrainerCallback

import gradwatch


class GradwatchCallback(TrainerCallback):
    def __init__(
        self, run: gradwatch.Run | None = None, watch_options: dict[str, Any] | None = None, **init: Any
    ):
        self.run = run
        self._owns_run = run is None
        self._init = init
        self._watch_options = watch_options or {}
        self._watching = False  # the run counts the Trainer's optimizer steps

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **_: Any
    ) -> None:
        if self.run is None:
            config = {k: v for k, v in args.to_dict().items() if isinstance(v, (str, int, float, bool))}
            self.run = gradwatch.init(config=config, **self._init)
        # Accelerate wraps the optimizer; hooks go on the torch optimizer inside, the scaler is its own.
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        scaler = getattr(optimizer, "scaler", None)
        if model is not None and torch_optimizer is not None:
            self.run.watch(model, torch_optimizer, scaler=scaler, **self._watch_options)
            self._watching = True

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any
    ) -> None:
        if self.run is None or not logs:
            return
        numeric = {
            f"hf/{k}": v for k, v in logs.items() if not isinstance(v, bool) and isinstance(v, numbers.Real)
        }
        if "hf/loss" in numeric:
            numeric["loss"] = numeric["hf/loss"]
        if numeric:
            # The Trainer logs after its optimizer step: the step done is the one before the counter
            # (the watched run's, else the Trainer's own global_step, which counts from 1).
            done = self.run.step if self._watching else getattr(state, "global_step", 0)
            self.run.log(numeric, step=max(done - 1, 0))

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.run is not None and self.run.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.run is not None and self._owns_run:
            self.run.finish()
