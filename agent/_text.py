"""Numbers as people read them, shared by the agent, the server's alert texts and the dashboard."""

from __future__ import annotations

import math

__all__ = ["power_of_two"]


def power_of_two(value: object) -> str | None:
    """ "2^k" when `value` is exactly a positive power of two (a loss scale usually is: 2^16, 2^-3),
    else None (the caller formats it its own way). Exact: read from the float's exponent, not a
    logarithm that rounds (log2(2^53 + 2) is 53.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        return None
    mantissa, exponent = math.frexp(number)
    return f"2^{exponent - 1}" if mantissa == 0.5 else None
