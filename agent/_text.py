"""What people read: numbers as they read them (shared by the agent, the server's alert texts and the
dashboard), and the agent's lines for the person watching a run."""

from __future__ import annotations

import logging
import math
import sys

__all__ = ["notice", "power_of_two"]

logger = logging.getLogger("gradwatch")


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


def notice(message: str) -> None:
    """A line for the person watching (progress): logged at INFO on the "gradwatch" logger when the
    application shows that logger's INFO records, else written to stderr; nothing when the
    application set the logger's level above INFO (or disabled it)."""
    if logger.disabled or logger.level > logging.INFO:
        return
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message)
        return
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # no usable stderr (closed, or a daemon's None)
        pass
