"""The rollup pyramid's shape and the summaries of scalar series (gradwatch.server.storage.rollups).

Level L of the pyramid summarises buckets of width(L) = BASE ** L steps, up to LEVELS; rollup rows
are keyed by (series_id, rank, level, bucket). A Summary holds a span's lowest and highest point as
stored (a non-finite point counts as the lowest), combine() joins adjacent spans' summaries, and
plain tuples (SummaryRow, with the field positions LOW_STEP ... POINT_COUNT) stand for them where
rows are read by the tens of thousands. Both maintenance paths and the queries build on these;
gradwatch.server.storage.rollups re-exports the public names.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.orm import Session

BASE = 32
LEVELS = 3

Executor = Session | Connection
_ROLLUP_KEY = ("series_id", "rank", "level", "bucket")
_POINT_ROLLUP_COLUMNS = (
    *_ROLLUP_KEY,
    "count",
    "low_step",
    "low_value",
    "low_flag",
    "high_step",
    "high_value",
    "high_flag",
)
_VECTOR_ROLLUP_COLUMNS = (*_ROLLUP_KEY, "count", "first_step", "data")


def width(level: int) -> int:
    return int(BASE**level)  # int ** int is typed Any (a negative exponent gives a float)


class Summary(NamedTuple):
    """The lowest and highest point of a span of steps, as stored (value NULL + flag if non-finite).
    Ties: the lowest is the earliest such point, the highest the latest. A tuple, so a database row
    of these columns becomes one without per-field work (queries read tens of thousands)."""

    low_step: int
    low_value: float | None
    low_flag: int
    high_step: int
    high_value: float | None
    high_flag: int
    point_count: int  # how many points the span holds (the rollup's `count` column)

    @classmethod
    def of_point(cls, step: int, value: float | None, flag: int) -> Summary:
        return cls(step, value, flag, step, value, flag, 1)


# A Summary as a plain tuple: a database row of its columns, or what combine() builds.
SummaryRow = tuple[int, float | None, int, int, float | None, int, int]
# Field positions: summaries are also plain tuples read from the database in this order.
LOW_STEP: Final = 0
LOW_VALUE: Final = 1
LOW_FLAG: Final = 2
HIGH_STEP: Final = 3
HIGH_VALUE: Final = 4
HIGH_FLAG: Final = 5
POINT_COUNT: Final = 6


def _low_key(s: SummaryRow) -> tuple[int, float | None, float]:
    # Non-finite first (earliest step), then the smallest value (earliest step on ties).
    return (0, s[LOW_STEP], 0.0) if s[LOW_FLAG] else (1, s[LOW_VALUE], s[LOW_STEP])


def combine(parts: list[SummaryRow]) -> SummaryRow:
    """One summary of adjacent spans' summaries."""
    if len(parts) == 1:
        return parts[0]
    low = min(parts, key=_low_key)
    finite_highs = [p for p in parts if not p[HIGH_FLAG]]
    if finite_highs:
        high = max(finite_highs, key=lambda p: (p[HIGH_VALUE], p[HIGH_STEP]))
        high_fields = high[HIGH_STEP:POINT_COUNT]
    else:  # nothing finite anywhere: the "highest" point is the first non-finite one
        high_fields = low[LOW_STEP:HIGH_STEP]
    return (*low[LOW_STEP:HIGH_STEP], *high_fields, sum(p[POINT_COUNT] for p in parts))


def _in(ids: list[int]) -> str:
    return ", ".join("?" for _ in ids)


# The point_rollups columns that hold a Summary's fields, in field order (point_count is `count`).
_SUMMARY_COLUMNS = ", ".join((*Summary._fields[:POINT_COUNT], "count"))
