"""Server-side downsampling that keeps every spike: the dashboard never pulls raw millions of points."""

from __future__ import annotations

import math
from collections.abc import Sequence


def min_max_indices(values: Sequence[float], max_points: int) -> list[int]:
    """Indices (ascending) of at most max_points of `values` that keep each bucket's extremes.

    The series is cut into max_points // 2 equal buckets; each keeps its minimum and maximum, so a
    one-step spike survives any zoom level. A bucket holding a non-finite value (NaN/±Inf: the very
    thing a user is looking for) keeps the first of them in place of its minimum.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max_points // 2
    kept: list[int] = []
    for b in range(buckets):
        lo = b * n // buckets
        hi = (b + 1) * n // buckets
        low_i = high_i = non_finite_i = -1
        for i in range(lo, hi):
            v = values[i]
            if not math.isfinite(v):
                if non_finite_i < 0:
                    non_finite_i = i
                continue
            if low_i < 0 or v < values[low_i]:
                low_i = i
            if high_i < 0 or v > values[high_i]:
                high_i = i
        chosen = {i for i in (non_finite_i if non_finite_i >= 0 else low_i, high_i) if i >= 0}
        kept.extend(sorted(chosen))
    return kept
