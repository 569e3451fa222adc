"""A Run: one training job's connection to gradwatch (its id, step counter, buffer and sender)."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from ._buffer import StepBuffer
from ._errors import FeatureSwitch, GradwatchWarning
from ._sender import Sender
from ._transport import HttpTransport, Transport
from ._wire import json_safe

logger = logging.getLogger("gradwatch")

DEFAULT_SERVER = "http://127.0.0.1:8765"
MODES = ("online", "offline")


class OfflineTransport:
    """Appends every request to a JSON-lines file instead of sending it (GRADWATCH_MODE=offline)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def create_run(self, run: dict[str, Any]) -> None:
        self._append({"type": "run", "run": run})

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None:
        self._append({"type": "batch", "run_id": run_id, "batch": batch})

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _environment_metadata() -> dict[str, Any]:
    meta: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "argv": sys.argv[:20],
        "git_commit": _git_commit(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
    return meta


class Run:
    """Records one training run. Create with gradwatch.init(); use as a context manager or call finish().

    Steps: the first optimizer step is step 0; each optimizer step (skipped or not) advances the
    counter by one; log() without step= attaches to the current counter value.
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        *,
        server: str = DEFAULT_SERVER,
        token: str | None = None,
        config: dict[str, Any] | None = None,
        mode: str = "online",
        run_id: str | None = None,
        rank: int = 0,
        transport: Transport | None = None,
        flush_interval: float = 1.0,
        flush_every_steps: int = 100,
    ) -> None:
        if not project or not isinstance(project, str):
            raise ValueError(f"project must be a non-empty string, got {project!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be positive (seconds), got {flush_interval!r}")
        self.id = run_id or uuid.uuid4().hex
        self.project = project
        self.name = name or self.id[:8]
        self.rank = rank
        self.mode = mode
        self.step = 0
        self.features = FeatureSwitch()
        self.buffer = StepBuffer()
        self.flush_interval = flush_interval
        self.flush_every_steps = flush_every_steps
        self._last_flush_time = time.monotonic()
        self._last_flush_step = 0
        self._watchers: list[Any] = []
        self._finished = False
        if transport is None:
            if mode == "offline":
                home = Path(os.environ.get("GRADWATCH_HOME") or Path.home() / ".gradwatch")
                transport = OfflineTransport(home / "offline" / f"{self.id}-rank{rank}.jsonl")
            else:
                transport = HttpTransport(server, token)
        self.server = server
        document = {
            "id": self.id,
            "project": project,
            "name": self.name,
            "config": json_safe(config or {}),
            "metadata": json_safe(_environment_metadata()),
        }
        self._sender = Sender(transport, document, rank)

    # -- public API -------------------------------------------------------------------------------

    def watch(self, model: Any, optimizer: Any, scaler: Any = None, **options: Any) -> Run:
        """Observe `optimizer`'s steps (and `scaler`'s loss scale) for the parameters of `model`.

        options (see WatchOptions): layer_norms_every=10, histograms_every=100, update_ratio_every=100
        (optimizer steps; 0 = off), samples_per_step / tokens_per_step for throughput.
        """
        from ._watch import Watcher, WatchOptions

        watch_options = WatchOptions(**options)
        if self._watchers:
            raise ValueError("this run already watches a model and optimizer; use one run per optimizer")

        if not hasattr(optimizer, "param_groups"):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(model, "named_parameters"):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if scaler is not None and not hasattr(scaler, "is_enabled"):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self._watchers.append(Watcher(self, model, optimizer, scaler, watch_options))
        return self

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        """Record scalars (numbers or one-element tensors, kept on their device) at `step`."""
        self.features.guarded("log")(self._log)(data, step)

    def finish(self, timeout: float = 10.0, status: str = "finished") -> None:
        """Flush, send what is queued (for at most `timeout` s) and close. Safe to call twice."""
        if self._finished:
            return
        self._finished = True
        for watcher in self._watchers:
            watcher.remove()
        self.features.guarded("flush")(self._flush)(status)
        if not self._sender.close(timeout):
            logger.warning(
                "gradwatch: run %s finished with data not yet sent after %.0f s (last error: %s)",
                self.id, timeout, self._sender.stats.last_error,
            )

    @property
    def stats(self) -> Any:
        """The agent's own health: points sent, dropped, queued, last error."""
        return self._sender.stats

    @property
    def url(self) -> str:
        """The run's dashboard page."""
        return f"{self.server.rstrip('/')}/dashboard/runs/{self.id}"

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(status="finished" if exc_type is None else "crashed")

    # -- internals --------------------------------------------------------------------------------

    def _log(self, data: dict[str, Any], step: int | None) -> None:
        if not isinstance(data, dict):
            warnings.warn(f"gradwatch: log() takes a dict, got {type(data).__name__}", GradwatchWarning, stacklevel=3)
            return
        at = self.step if step is None else int(step)
        for key, value in data.items():
            if isinstance(value, bool) or not (isinstance(value, (int, float)) or getattr(value, "numel", lambda: 0)() == 1):
                warnings.warn(
                    f"gradwatch: log() ignored {key!r}: expected a number or a one-element tensor, "
                    f"got {type(value).__name__}",
                    GradwatchWarning,
                    stacklevel=3,
                )
                continue
            self.buffer.add_scalar(str(key), at, value)
        self._maybe_flush()

    def _after_step(self) -> None:
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        due_by_time = time.monotonic() - self._last_flush_time >= self.flush_interval
        if due_by_time or self.step - self._last_flush_step >= self.flush_every_steps:
            self.features.guarded("flush")(self._flush)(None)

    def _record_device_memory(self) -> None:
        """Peak device memory (bytes) once per flush: an allocator counter, no device sync."""
        torch = sys.modules.get("torch")
        if torch is not None and self._watchers and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.buffer.add_scalar("sys/max_memory_allocated", self.step, float(torch.cuda.max_memory_allocated()))

    def _flush(self, status: str | None) -> None:
        self._last_flush_time = time.monotonic()
        self._last_flush_step = self.step
        if not len(self.buffer) and status is None:
            return
        self._record_device_memory()
        packet = self.buffer.take([w.derive for w in self._watchers], status)
        self._sender.submit(packet)
