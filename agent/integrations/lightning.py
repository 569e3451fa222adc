"""PyTorch Lightning integration.

    from gradwatch.integrations.lightning import GradwatchCallback
    trainer = L.Trainer(precision="16-mixed", callbacks=[GradwatchCallback(project="llm")])

Watches the LightningModule with the trainer's first optimizer (and the precision plugin's GradScaler
when there is one), records each optimizer step's training loss (kept on the device: with
accumulate_grad_batches=k, the sum of its k micro-batch losses as Lightning passes them on, each
divided by k: their mean) and finishes the run at the end of fit. Pass run= to use a run you created
yourself (it is then not finished here).
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]  # the same API under the old name

import gradwatch


class GradwatchCallback(pl.Callback):
    def __init__(
        self, run: gradwatch.Run | None = None, watch_options: dict[str, Any] | None = None, **init: Any
    ):
        self.run = run
        self._owns_run = run is None
        self._init = init
        self._watch_options = watch_options or {}
        self._step_loss: Any = None  # the running step's micro-batch losses so far (on the device)
        self._steps_seen: int | None = (
            None  # the run's step counter at the last batch end (None: not watching)
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run is None:
            self._init.setdefault("rank", trainer.global_rank)
            self.run = gradwatch.init(config=dict(getattr(pl_module, "hparams", {}) or {}), **self._init)
        if not trainer.optimizers:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.run.watch(pl_module, trainer.optimizers[0], scaler=scaler, **self._watch_options)
        self._steps_seen = self.run.step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.run is None:
            return
        if self.run.should_stop:  # the guard (watch_options={"guard": ...}) stopped training
            trainer.should_stop = True
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None or not hasattr(loss, "detach"):
            return
        if self._steps_seen is None:  # nothing watched: no step counter moves, the batch is the step
            self.run.log({"loss": loss.detach()}, step=max(self.run.step - 1, 0))
            return
        loss = loss.detach()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if self.run.step != self._steps_seen:
            # This batch's optimizer step ran (a micro-batch that only accumulated leaves the counter):
            # the loss belongs to the step before the counter.
            self.run.log({"loss": self._step_loss}, step=max(self.run.step - 1, 0))
            self._step_loss, self._steps_seen = None, self.run.step

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None and self._owns_run:
            self.run.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.run is not None and self._owns_run:
            self.run.finish(status="crashed")
