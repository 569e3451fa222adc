"""What people read: numbers as they read them (shared by the agent, the server's alert texts and the
dashboard), and the agent's lines for the person watching a run."""

from __future__ import annotations

import logging
import math
import sys

__all__ = ["notice", "power_of_two", "scale", "scale_change"]

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


def scale(value: object) -> str:
    """A loss scale as people read it: "2^16" where it is a power of two, else 3 significant digits;
    "NaN"/"Infinity" as such and "unknown" for anything that is not a number."""
    power = power_of_two(value)
    if power is not None:
        return power
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity") else "unknown"
    return f"{float(value):.3g}"


def scale_change(before: object, after: object) -> str:
    """ "2^17 -> 2^13 (16x)": one fall (or rise) of the loss scale, worded the same wherever it is told
    (the run page's skip rows, the scale_drop alert), so one event never shows two magnitudes."""
    text = f"{scale(before)} -> {scale(after)}"
    if isinstance(before, bool) or isinstance(after, bool):
        return text
    if not (isinstance(before, (int, float)) and isinstance(after, (int, float))):
        return text
    if not (math.isfinite(before) and math.isfinite(after)) or before <= 0 or after < 0:
        return text
    if after == 0:
        return f"{text} (to zero)"
    ratio = before / after if before >= after else after / before
    if ratio >= 1e6:  # a fall through many powers of two: "2^130x", not 39 digits
        times = f"{power_of_two(ratio) or f'{ratio:.3g}'}x"
    else:
        times = f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"
    return f"{text} ({times})" if before != after else text


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
