"""The wire format between agent and server: JSON documents, non-finite floats as strings."""

from __future__ import annotations

import math
from typing import Any


def wire_float(value: float) -> float | str:
    """A float for the wire: finite as a number, else "NaN" / "Infinity" / "-Infinity"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def json_safe(obj: Any) -> Any:
    """Make a document strict-JSON safe (floats via wire_float, unknown objects via str)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return wire_float(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return str(obj)
