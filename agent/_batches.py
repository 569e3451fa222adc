"""Which samples each step trained on, kept on the host, and `bad_batch` events that name them.

Run.log_batch() files a step's batch ids (sample indices, file names, shard:offset…) in a bounded
ring; nothing is sent per step. When the sender thread resolves a non-finite `loss` (the user's
run.log) or `amp/loss` (the losses passed to scaler.scale), one `bad_batch` event at that step
carries the ids logged for it, so the offending samples can be found and skipped on a rerun; the
steps after it whose loss is NaN only because its update put NaN into the weights are not named.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice
from typing import Any

from ._buffer import Resolved
from ._wire import wire_float

MAX_STEPS = 1024  # steps whose ids are kept (the most recent ones)
MAX_IDS_PER_STEP = 64
MAX_ID_CHARS = 200
MAX_BAD_BATCH_EVENTS = 100  # per run: a run that is NaN forever stays bounded
LOSS_KEYS = ("loss", "amp/loss")

BatchId = int | str


def normalize_ids(ids: Any) -> list[BatchId]:
    """`ids` as a list of at most MAX_IDS_PER_STEP ints / strings (cut at MAX_ID_CHARS characters).

    Accepts an int, a str, a sequence (or other iterable) of ints/strs, or an integer tensor on the
    CPU (a device tensor would need a sync to read). Raises TypeError (or ValueError for a device
    tensor) naming what it got otherwise.
    """
    torch = sys.modules.get("torch")  # not imported here: a tensor can only come from a loaded torch
    if isinstance(ids, (str, numbers.Integral)):
        ids = (ids,)
    elif torch is not None and isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise ValueError(
                f"ids must be on the host, got a tensor on {ids.device} (reading it would synchronise "
                "with the device)"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"ids must be integers, got a {ids.dtype} tensor")
        ids = ids.reshape(-1)[:MAX_IDS_PER_STEP].tolist()  # a CPU tensor (checked above): no device sync
    elif isinstance(ids, (bytes, bytearray, dict)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be an int, a str or a sequence of them, got {type(ids).__name__}")
    out: list[BatchId] = []
    for item in islice(ids, MAX_IDS_PER_STEP):
        if isinstance(item, str):
            out.append(item[:MAX_ID_CHARS])
        elif not isinstance(item, bool) and isinstance(item, numbers.Integral):
            out.append(int(item))
        else:
            raise TypeError(f"ids must be ints or strs, got {type(item).__name__} {item!r:.50}")
    return out


def _plain_text(value: BatchId) -> BatchId:
    """A string the server stores as text: no NUL, no lone surrogates."""
    if isinstance(value, int):
        return value
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


class BatchLog:
    """The ring of recent steps' batch ids (thread-safe) and the bad_batch derivation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: OrderedDict[int, list[BatchId]] = OrderedDict()
        self._reported: set[int] = set()  # steps with a bad_batch event (at most MAX_BAD_BATCH_EVENTS)
        self._weights_poisoned = False  # the last loss was not finite and its update was applied

    def add(self, step: int, ids: list[BatchId]) -> None:
        """File `ids` under `step` (training thread); a step logged twice keeps both, up to the cap."""
        with self._lock:
            kept = self._ids.get(step)
            if kept is None:
                self._ids[step] = kept = []
                if len(self._ids) > MAX_STEPS:
                    self._ids.popitem(last=False)
            kept.extend(ids[: MAX_IDS_PER_STEP - len(kept)])

    def shift_steps(self, delta: int) -> None:
        """Renumber the steps kept by `delta` (a resumed run learning its step, before any flush)."""
        if delta:
            with self._lock:
                self._ids = OrderedDict((step + delta, ids) for step, ids in self._ids.items())

    def ids_at(self, step: int) -> list[BatchId] | None:
        """The ids logged for `step`, or None when none were (or they have left the ring)."""
        with self._lock:
            kept = self._ids.get(step)
            return None if kept is None else list(kept)

    def derive(self, resolved: Resolved) -> None:
        """(sender thread) One `bad_batch` event per step whose loss or amp/loss is not finite and
        whose weights were not already: a non-finite loss whose update was applied (no GradScaler
        skipped it, and its gradient norm is not known finite) puts NaN into the weights, so every
        loss after it is NaN whatever its batch; those batches are not named, until a loss is
        finite again."""
        if len(self._reported) >= MAX_BAD_BATCH_EVENTS:
            return
        losses: dict[int, tuple[str, float] | None] = {}
        for key in LOSS_KEYS:
            for step, value in resolved.scalar_points(key):
                if losses.get(step) is None:
                    losses[step] = None if math.isfinite(value) else (key, value)
        skipped = {step for step, flag in resolved.scalar_points("amp/skipped") if flag >= 0.5}
        finite_gradients = {
            s for s, norm in resolved.scalar_points("grad/global_norm") if math.isfinite(norm)
        }
        bad: dict[int, tuple[str, float]] = {}
        for step in sorted(losses):
            culprit = losses[step]
            if culprit is None:
                self._weights_poisoned = False
                continue
            if not self._weights_poisoned and step not in self._reported:
                bad[step] = culprit
            self._weights_poisoned = step not in skipped and step not in finite_gradients
        for step in sorted(bad):
            if len(self._reported) >= MAX_BAD_BATCH_EVENTS:
                break
            self._reported.add(step)
            key, value = bad[step]
            ids = self.ids_at(step)
            resolved.events.append(
                {
                    "step": step,
                    "kind": "bad_batch",
                    "data": {
                        "key": key,
                        "value": wire_float(value),
                        "ids": [_plain_text(i) for i in ids or []],
                        "ids_logged": ids is not None,
                    },
                }
            )
