"""Hugging Face Accelerate integration: a tracker for `Accelerator(log_with=...)`.

    from gradwatch.integrations.accelerate import GradwatchTracker
    tracker = GradwatchTracker(project="llm", name="run-1")
    accelerator = Accelerator(mixed_precision="fp16", log_with=[tracker])
    accelerator.init_trackers("llm", config={"lr": 3e-4})        # the run's config
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker.watch(accelerator, model, optimizer)                # gradients, loss scale, skipped steps
    ...
    accelerator.log({"loss": loss.item()}, step=step)          # as with any tracker
    accelerator.end_training()                                  # finishes the run

Every process records (main_process_only is False): each rank reports its own gradients under its
rank and all ranks share one run (see gradwatch.init). Accelerate itself calls init_trackers, log and
end_training on the main process only, so the config and accelerator.log's values come from rank 0,
and the other ranks' runs are finished when their processes end. watch() unwraps what prepare() returned: the
model (DDP, torch.compile), the AcceleratedOptimizer, and takes the Accelerator's GradScaler when
mixed precision uses one. The run is created when it is first needed (init_trackers' config, a
log, watch), so Accelerate has set up the processes by then. Strings in log() are left out: gradwatch
records numbers.
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

import gradwatch

__all__ = ["GradwatchTracker"]


class GradwatchTracker(GeneralTracker):  # type: ignore[misc]  # accelerate ships no type information
    name = "gradwatch"
    requires_logging_directory = False
    main_process_only = False  # every rank reports its gradients (and gradwatch shares one run)

    def __init__(self, run: gradwatch.Run | None = None, **init: Any) -> None:
        """init: gradwatch.init's arguments (project, name, server, token, ...); or run= a run you made
        (then it is not finished here)."""
        super().__init__()
        self._run = run
        self._owns_run = run is None
        self._init = init

    @property
    def tracker(self) -> gradwatch.Run:
        """The gradwatch Run (created on first use)."""
        return self._ensure_run()

    def _ensure_run(self, config: dict[str, Any] | None = None) -> gradwatch.Run:
        if self._run is None:
            options = dict(self._init)
            if config is not None:
                options["config"] = {**options.get("config", {}), **config}
            self._run = gradwatch.init(**options)
        return self._run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        if self._run is None:
            self._ensure_run(config=dict(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers = {k: v for k, v in values.items() if not isinstance(v, (str, bytes))}
        if numbers:
            self._ensure_run().log(numbers, step=step)

    def watch(self, accelerator: Any, model: Any, optimizer: Any, **options: Any) -> gradwatch.Run:
        """Watch what accelerator.prepare() returned: the model, its optimizer (the AcceleratedOptimizer
        is unwrapped) and the Accelerator's GradScaler (fp16 mixed precision), with watch()'s options."""
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the real one
        scaler = getattr(accelerator, "scaler", None)
        return self._ensure_run().watch(model, inner, scaler=scaler, **options)

    def stop_requested(self, accelerator: Any) -> bool:
        """Whether to stop, the same answer on every process: sets the Accelerator's trigger when this
        run's guard (watch(..., guard=...)) stopped training, then reads it with check_trigger (a
        collective: call it at the same step on every process). `if tracker.stop_requested(accelerator):
        break`."""
        if self._run is not None and self._run.should_stop:
            accelerator.set_trigger()
        return bool(accelerator.check_trigger())

    def finish(self) -> None:
        if self._run is not None and self._owns_run:
            self._run.finish()
