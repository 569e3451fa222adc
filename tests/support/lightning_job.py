"""Lightning's ddp_spawn on CPU with gradwatch's callback (see launch_jobs): module level, because
ddp_spawn pickles the LightningModule and the callbacks into its processes by reference."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from launch_jobs import _model, _record
from torch import nn

from gradwatch.integrations.lightning import GradwatchCallback


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingCallback(GradwatchCallback):
    """GradwatchCallback that also writes what its rank saw (launch_jobs' OUT/rank{R}.json)."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(
            project=job["project"], server=job["server"], spool_dir=job["spool_dir"], flush_interval=0.1
        )
        self.job = job

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_end(trainer, pl_module)
        _record(self.job, trainer.global_rank, self.run)


def fit(job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=job.get("steps", 3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RecordingCallback(job)],
    )
    trainer.fit(TinyModule(), torch.utils.data.DataLoader(data, batch_size=4))
