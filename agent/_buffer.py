"""Between flushes, observations wait here; tensors stay on their device until the flush.

A flush concatenates every buffered tensor into one flat float64 tensor (exact for float32 values
and for counts up to 2^53) and starts ONE non-blocking
copy to the host (pinned memory on CUDA). The sender thread waits for that copy and reads the values,
so the training thread never synchronises with the device on gradwatch's behalf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

_first, _second = itemgetter(0), itemgetter(1)  # of (step, value) points, at C speed

# (key, step, start offset in the flat tensor, shape: () scalar, (n,) vector, (rows, columns) matrix)
_Slot = tuple[str, int, int, tuple[int, ...]]


class Resolved:
    """A packet's values on the host: key → [(step, value)], [(step, [values])], [(step, [[row]])].

    Numbers logged on the host (Run.log) arrive as per-key (steps, values) columns and stay columns
    until something asks for `scalars`: wire_fields sends them as they are, so a hundred keys at
    thousands of steps cost no (step, value) pair each. Reading `scalars` (the derivers do) joins them
    in, in step order, once; `scalar_points` reads one key without that.
    """

    def __init__(
        self,
        scalars: dict[str, list[tuple[int, float]]],
        vectors: dict[str, list[tuple[int, list[float]]]],
        matrices: dict[str, list[tuple[int, list[list[float]]]]],
        events: list[dict[str, Any]],
        layers: list[str] | None = None,
        host_columns: dict[str, tuple[list[int], list[float]]] | None = None,
    ) -> None:
        self._scalars = scalars
        self._columns = host_columns or {}  # key -> (steps, values) in log order, not yet in _scalars
        self.vectors = vectors
        self.matrices = matrices
        self.events = events
        self.layers = layers  # names of the vectors' entries, in the model's order

    @property
    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """key → [(step, value)] in step order (a step logged twice keeps its order), host columns
        included."""
        if self._columns:
            columns, self._columns = self._columns, {}
            for key, (steps, values) in columns.items():
                points = self._scalars.get(key)
                if points is None:
                    points = self._scalars[key] = list(zip(steps, values, strict=True))
                else:
                    points.extend(zip(steps, values, strict=True))
                points.sort(key=_first)  # stable; O(n) when sorted
        return self._scalars

    def scalar_points(self, key: str) -> list[tuple[int, float]]:
        """One key's (step, value) points in step order, without joining the other host columns in."""
        column = self._columns.get(key)
        if column is None:
            return self._scalars.get(key, [])
        points = [*self._scalars.get(key, []), *zip(*column, strict=True)]
        points.sort(key=_first)
        return points

    def wire_fields(self) -> dict[str, Any]:
        """The data part of a wire batch. Keys starting with "_" are agent-internal and stay here."""
        from ._wire import json_safe, wire_float

        def public(table: dict[str, Any]) -> list[tuple[str, Any]]:
            return [(key, points) for key, points in table.items() if not key.startswith("_") and points]

        def wire_values(values: list[float]) -> list[Any]:
            # A non-finite value makes the sum non-finite (an overflowing sum only takes the long way).
            if math.isfinite(sum(values)) or all(map(math.isfinite, values)):
                return values
            return [wire_float(v) for v in values]

        scalars = [
            {
                "key": key,
                "steps": list(map(_first, points)),
                "values": wire_values(list(map(_second, points))),
            }
            for key, points in public(self._scalars)
            if key not in self._columns
        ]
        for key, (steps, values) in self._columns.items():
            if key.startswith("_") or not steps:
                continue
            if key in self._scalars or sorted(steps) != steps:
                points = self.scalar_points(key)  # out of step order, or joining device values
                steps, values = list(map(_first, points)), list(map(_second, points))
            scalars.append({"key": key, "steps": steps, "values": wire_values(values)})
        fields: dict[str, Any] = {
            "scalars": scalars,
            "events": [json_safe(event) for event in self.events],
        }
        vectors = public(self.vectors)
        if vectors:
            fields["vectors"] = [
                {
                    "key": key,
                    "steps": [s for s, _ in points],
                    "values": [[wire_float(v) for v in row] for _, row in points],
                }
                for key, points in vectors
            ]
        histograms = public(self.matrices)
        if histograms:
            from ._quantities import EXPONENT_MAX, EXPONENT_MIN

            fields["histograms"] = [
                {
                    "key": key,
                    "step": step,
                    "exponent_min": EXPONENT_MIN,
                    "exponent_max": EXPONENT_MAX,
                    "counts": [[int(c) for c in row] for row in rows],
                }
                for key, points in histograms
                for step, rows in points
            ]
        if (vectors or histograms) and self.layers is not None:
            fields["layers"] = list(self.layers)
        return fields


@dataclass
class Packet:
    """One flush: device values in flight to the host, plus host-side values and events."""

    slots: list[_Slot]
    host_values: Any  # torch.Tensor on the host (maybe still being filled) or None
    ready: Any  # torch.cuda.Event marking the copy's completion, or None
    host_scalars: dict[str, tuple[list[int], list[float]]]  # key -> (steps, values), in log order
    events: list[dict[str, Any]]
    status: str | None = None
    # Called on the sender thread with the resolved values; each may append events.
    derivers: list[Callable[[Resolved], None]] = field(default_factory=list)

    @property
    def points(self) -> int:
        """Points the packet carries (one key at one step each; device slots and host values)."""
        return len(self.slots) + host_points(self.host_scalars)

    def fragment(self) -> dict[str, Any]:
        """resolve() as the data part of a wire batch (no rank or seq yet), with the run status if any."""
        fragment: dict[str, Any] = dict(self.resolve().wire_fields())
        if self.status is not None:
            fragment["status"] = self.status
        return fragment

    def resolve(self) -> Resolved:
        """Wait for the device copy (sender thread only) and return plain Python values."""
        flat: list[float] = []
        if self.host_values is not None:
            if self.ready is not None:
                self.ready.synchronize()
            flat = self.host_values.tolist()  # off the training thread: this is the sender's read
        scalars: dict[str, list[tuple[int, float]]] = {}
        vectors: dict[str, list[tuple[int, list[float]]]] = {}
        matrices: dict[str, list[tuple[int, list[list[float]]]]] = {}
        for key, step, start, shape in self.slots:
            if len(shape) == 0:
                scalars.setdefault(key, []).append((step, flat[start]))
            elif len(shape) == 1:
                vectors.setdefault(key, []).append((step, flat[start : start + shape[0]]))
            else:
                rows, columns = shape
                matrix = [flat[start + r * columns : start + (r + 1) * columns] for r in range(rows)]
                matrices.setdefault(key, []).append((step, matrix))
        for points in scalars.values():
            points.sort(key=_first)  # stable (a step logged twice keeps its order); O(n) when sorted
        resolved = Resolved(scalars, vectors, matrices, list(self.events), host_columns=self.host_scalars)
        for derive in self.derivers:
            derive(resolved)
        return resolved


def host_points(columns: dict[str, tuple[list[int], list[float]]]) -> int:
    """How many points host-number columns hold."""
    return sum(len(steps) for steps, _ in columns.values())


class StepBuffer:
    """Collects (key, step, value) observations of the training thread until the next flush."""

    def __init__(self) -> None:
        self._tensors: list[tuple[str, int, Any]] = []
        # Host numbers by key, as (steps, values) columns: Run.log of a hundred keys a step appends to
        # them directly (host_columns), and the sender takes them without regrouping point by point.
        self._host: dict[str, tuple[list[int], list[float]]] = {}
        self._events: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._tensors) + host_points(self._host) + len(self._events)

    @property
    def host_columns(self) -> dict[str, tuple[list[int], list[float]]]:
        """key -> (steps, values) of the host numbers add_scalar took: Run.log appends to them directly
        for plain floats and ints (a hundred keys a step cost a method call each otherwise)."""
        return self._host

    def add_scalar(self, key: str, step: int, value: Any) -> None:
        """A number or a one-element tensor (kept on its device, detached)."""
        if isinstance(value, (int, float)):
            column = self._host.get(key)
            if column is None:
                column = self._host[key] = ([], [])
            column[0].append(step)
            column[1].append(float(value))
        else:
            if value.requires_grad:
                value = value.detach()
            self._tensors.append((key, step, value if value.dim() == 0 else value.reshape(())))

    def add_tensor(self, key: str, step: int, tensor: Any) -> None:
        """A 1-d tensor (one value per layer) or a 2-d one (a histogram row per layer)."""
        self._tensors.append((key, step, tensor.detach()))

    def add_event(self, step: int, kind: str, data: dict[str, Any]) -> None:
        self._events.append({"step": step, "kind": kind, "data": data})

    def shift_steps(self, delta: int) -> None:
        """Renumber everything buffered by `delta` steps (a resumed run learning its step)."""
        if delta:
            self._tensors = [(key, step + delta, tensor) for key, step, tensor in self._tensors]
            for steps, _ in self._host.values():
                steps[:] = [step + delta for step in steps]
            for event in self._events:
                event["step"] += delta

    def take(self, derivers: list[Callable[[Resolved], None]], status: str | None = None) -> Packet:
        """Empty the buffer into a Packet, starting the single device→host copy."""
        slots: list[_Slot] = []
        host_values = ready = None
        if self._tensors:
            import torch

            # The 0-dim tensors (about ten a step: scale, loss, norms…) go first, in one stack: a
            # conversion call per tensor would cost the training thread ~10 µs each at every flush.
            scalar_tensors: list[Any] = []
            parts = []
            offset = 0
            for key, step, tensor in self._tensors:
                if tensor.dim() == 0:
                    slots.append((key, step, len(scalar_tensors), ()))
                    scalar_tensors.append(tensor)
            if scalar_tensors:
                parts.append(torch.stack(scalar_tensors).to(torch.float64))
                offset = len(scalar_tensors)
            for key, step, tensor in self._tensors:
                if tensor.dim() != 0:
                    part = tensor.reshape(-1).to(torch.float64)
                    parts.append(part)
                    slots.append((key, step, offset, tuple(tensor.shape)))
                    offset += part.numel()
            flat = torch.cat(parts)
            if flat.device.type == "cuda":
                host_values = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
                host_values.copy_(flat, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            elif flat.device.type == "cpu":
                host_values = flat
            else:  # other accelerators: a plain copy; still one transfer per flush
                host_values = flat.to("cpu", non_blocking=True)
        packet = Packet(slots, host_values, ready, self._host, self._events, status, list(derivers))
        self._tensors, self._host, self._events = [], {}, []
        return packet
