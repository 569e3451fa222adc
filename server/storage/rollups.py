"""Rollups: pre-aggregated pyramids of scalar series and per-layer vectors, so that a query over any
step range reads at most a few tens of thousands of rows, however long the run.

Level L (1..LEVELS) summarises steps [b * W, (b + 1) * W) with W = BASE ** L:
- a scalar series keeps the bucket's lowest and highest point with their steps (a NaN/±Inf point
  counts as the lowest, so a non-finite value is never hidden) and how many points it holds;
- a per-layer vector keeps, per layer, the first non-finite value or else the largest (what a heatmap
  cell shows) and the bucket's first step.
Level 0 is the stored data itself.

Maintenance runs inside the ingest transaction: the buckets a batch touches are recomputed from the
level below rather than merged into, so a step written again (a run resumed from a checkpoint re-logs
old steps) leaves no stale extreme behind. Queries take whole buckets of the coarsest level that fits
and the finer levels only at the range's two edges; with query buckets that are multiples of that
level's width every summary falls inside one query bucket, so the result equals a min/max
downsampling of the raw points.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from ..models import Flag, PointRollup, VectorPoint, VectorRollup
from . import bulk, chunked_points

BASE = 32
LEVELS = 3
# Buckets further apart than this are refreshed with separate range reads; closer ones with one read.
_MAX_GAP_BUCKETS = 64

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


def _intervals(buckets: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted bucket indices grouped into [first, last] runs, merging gaps of up to _MAX_GAP_BUCKETS."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(buckets)):
        if runs and b - runs[-1][1] <= _MAX_GAP_BUCKETS:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs


# -- scalar series ----------------------------------------------------------------------------------


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


def _read_points(
    executor: Executor, series_ids: list[int], rank: int, lo: int, hi: int
) -> list[tuple[Any, ...]]:
    """(series_id, step, value, flag) of the points with lo <= step < hi."""
    return [
        (sid, *row)
        for sid in series_ids
        for points in chunked_points.read(executor, sid, [rank], lo, hi).values()
        for row in chunked_points.rows(points)
    ]


# The point_rollups columns that hold a Summary's fields, in field order (point_count is `count`).
_SUMMARY_COLUMNS = ", ".join((*Summary._fields[:POINT_COUNT], "count"))


def _read_point_rollups(
    executor: Executor, series_ids: list[int], rank: int, level: int, lo: int, hi: int
) -> Sequence[tuple[Any, ...]]:
    """(series_id, bucket, *Summary fields) rows of `level` whose bucket lies in [lo, hi)."""
    return bulk.fetch(
        executor,
        f"SELECT series_id, bucket, {_SUMMARY_COLUMNS} FROM point_rollups"
        f" WHERE series_id IN ({_in(series_ids)})"
        " AND rank = ? AND level = ? AND bucket >= ? AND bucket < ?",
        [*series_ids, rank, level, lo, hi],
    )


def _group_points(
    groups: dict[tuple[int, int], list[SummaryRow]], rows: Iterable[Any], bucket_width: int
) -> None:
    """Summaries per (series, bucket of steps) straight from raw rows: tuples compare as (value, step),
    so min() and max() give the lowest point (earliest on ties) and the highest (latest) at C speed."""
    raw: dict[tuple[int, int], list[tuple[Any, int, int]]] = defaultdict(list)
    non_finite: set[tuple[int, int]] = set()
    for sid, step, value, flag in rows:
        bucket = (sid, step // bucket_width)
        raw[bucket].append((value, step, flag))
        if flag:
            non_finite.add(bucket)
    for bucket, members in raw.items():
        if bucket in non_finite:
            groups[bucket].append(
                combine([Summary.of_point(step, value, flag) for value, step, flag in members])
            )
        else:
            low, high = min(members), max(members)
            groups[bucket].append(Summary(low[1], low[0], 0, high[1], high[0], 0, len(members)))


def point_summaries(
    executor: Executor, series_id: int, rank: int, lo: int, hi: int, level: int, bucket_width: int
) -> _Spans:
    """Summaries covering exactly the steps [lo, hi), none straddling a multiple of bucket_width (a
    multiple of level's width), in step order: whole buckets of `level`, finer ones at the edges, and
    raw points summarised per bucket_width at level 0. Columns, not rows: a read of 100,000 points
    grouped in Python objects took ~1 s of the server's one interpreter."""
    if hi <= lo:
        return _Spans.empty()
    if level == 0:
        points = chunked_points.read(executor, series_id, [rank], lo, hi).get(rank)
        if points is None or not len(points):
            return _Spans.empty()
        return _Spans.of_points({series_id: points}).coarser(bucket_width)
    w = width(level)
    first, last = -(-lo // w), hi // w  # whole buckets [first, last)
    if first >= last:
        return point_summaries(executor, series_id, rank, lo, hi, level - 1, bucket_width)
    return _Spans.concatenate(
        [
            point_summaries(executor, series_id, rank, lo, first * w, level - 1, bucket_width),
            _Spans.of_rollup_rows(_read_point_rollups(executor, [series_id], rank, level, first, last)),
            point_summaries(executor, series_id, rank, last * w, hi, level - 1, bucket_width),
        ]
    )


def plan(first: int, last: int, buckets: int) -> tuple[int, int]:
    """(level, bucket width) to summarise steps [first, last] into at most `buckets` buckets aligned
    to multiples of the width: the coarsest level not wider than the ideal bucket, and the smallest
    multiple of that level's width whose aligned buckets fit."""
    buckets = max(buckets, 1)
    ideal = -(-(last - first + 1) // buckets)
    level = 0
    while level < LEVELS and width(level + 1) <= ideal:
        level += 1
    w = width(level)
    bucket_width = -(-ideal // w) * w
    while last // bucket_width - first // bucket_width + 1 > buckets:
        bucket_width += w
    return level, bucket_width


def downsample(summaries: _Spans, bucket_width: int) -> tuple[list[int], list[float], int]:
    """The lowest and highest point of each bucket of steps (at most two per bucket, in step order,
    non-finite values as such) as (steps, values), and the number of points summarised."""
    if not len(summaries.low_step):
        return [], [], 0
    # Every summary lies inside one bucket: group them by their first step's bucket.
    buckets = summaries.rebucketed(summaries.low_step).coarser(bucket_width)
    low_first = buckets.low_step <= buckets.high_step
    first_step = np.where(low_first, buckets.low_step, buckets.high_step)
    first_value = np.where(low_first, buckets.low_value, buckets.high_value)
    second_step = np.where(low_first, buckets.high_step, buckets.low_step)
    second_value = np.where(low_first, buckets.high_value, buckets.low_value)
    keep = np.column_stack((np.ones(len(first_step), dtype=bool), second_step != first_step)).ravel()
    steps = np.column_stack((first_step, second_step)).ravel()[keep]
    values = np.column_stack((first_value, second_value)).ravel()[keep]
    return steps.tolist(), values.tolist(), int(buckets.count.sum())


# -- per-layer vectors ------------------------------------------------------------------------------


def to_array(data: bytes) -> np.ndarray:
    array = np.frombuffer(data, dtype="<f8")
    return array if sys.byteorder == "little" else array.astype(np.float64)


def to_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype="<f8").tobytes()


def worst_per_bucket(matrix: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Rows of `matrix` (in step order) grouped at `starts`: per column, the group's first non-finite
    value, else its largest. One vectorised pass; the rare non-finite cells are fixed up one by one."""
    bad = ~np.isfinite(matrix)
    merged = np.maximum.reduceat(np.where(bad, -np.inf, matrix), starts, axis=0)
    if bad.any():
        ends = np.append(starts[1:], len(matrix))
        for group, column in zip(*np.nonzero(np.logical_or.reduceat(bad, starts, axis=0)), strict=True):
            rows = starts[group] + np.flatnonzero(bad[starts[group] : ends[group], column])
            merged[group, column] = matrix[rows[0], column]
    return merged


@dataclass(frozen=True, slots=True)
class VectorSummary:
    first_step: int
    count: int
    values: np.ndarray


def _read_vector_rows(
    executor: Executor, series_ids: list[int], rank: int, lo: int, hi: int
) -> Sequence[tuple[Any, ...]]:
    """(series_id, step, data) of the rows with lo <= step < hi."""
    return bulk.fetch(
        executor,
        f"SELECT series_id, step, data FROM vector_points WHERE series_id IN ({_in(series_ids)})"
        " AND rank = ? AND step >= ? AND step < ?",
        [*series_ids, rank, lo, hi],
    )


def _read_vector_rollups(
    executor: Executor, series_ids: list[int], rank: int, level: int, lo: int, hi: int
) -> Sequence[tuple[Any, ...]]:
    """(series_id, bucket, first_step, count, data) rows of `level` whose bucket lies in [lo, hi)."""
    return bulk.fetch(
        executor,
        f"SELECT series_id, bucket, first_step, count, data FROM vector_rollups WHERE series_id IN"
        f" ({_in(series_ids)}) AND rank = ? AND level = ? AND bucket >= ? AND bucket < ?",
        [*series_ids, rank, level, lo, hi],
    )


def _merge(parts: list[VectorSummary]) -> VectorSummary:
    parts.sort(key=lambda p: p.first_step)
    if len(parts) == 1:
        return parts[0]
    if len({p.values.shape for p in parts}) != 1:  # the run's layer list changed: keep the latest rows
        shape = parts[-1].values.shape
        parts = [p for p in parts if p.values.shape == shape]
    matrix = np.vstack([p.values for p in parts])
    values = worst_per_bucket(matrix, np.array([0]))[0]
    return VectorSummary(parts[0].first_step, sum(p.count for p in parts), values)


def vector_summaries(
    executor: Executor, series_id: int, rank: int, lo: int, hi: int, level: int, bucket_width: int
) -> list[VectorSummary]:
    """Summaries covering exactly the steps [lo, hi), none straddling a multiple of bucket_width, in
    step order; raw rows are merged per bucket_width at level 0."""
    if hi <= lo:
        return []
    if level == 0:
        rows = sorted(_read_vector_rows(executor, [series_id], rank, lo, hi), key=lambda row: row[1])
        rows = [row for row in rows if len(row[2]) == len(rows[-1][2])]  # the latest layer count
        if not rows:
            return []
        buckets = np.array([step // bucket_width for _, step, _ in rows])
        starts = np.flatnonzero(np.diff(buckets, prepend=buckets[0] - 1))
        counts = np.diff(np.append(starts, len(rows)))
        merged = worst_per_bucket(np.vstack([to_array(data) for _, _, data in rows]), starts)
        return [
            VectorSummary(rows[i][1], int(n), merged[k])
            for k, (i, n) in enumerate(zip(starts, counts, strict=True))
        ]
    w = width(level)
    first, last = -(-lo // w), hi // w
    if first >= last:
        return vector_summaries(executor, series_id, rank, lo, hi, level - 1, bucket_width)
    middle = [
        VectorSummary(first_step, count, to_array(data))
        for _, _, first_step, count, data in _read_vector_rollups(
            executor, [series_id], rank, level, first, last
        )
    ]
    return [
        *vector_summaries(executor, series_id, rank, lo, first * w, level - 1, bucket_width),
        *sorted(middle, key=lambda s: s.first_step),
        *vector_summaries(executor, series_id, rank, last * w, hi, level - 1, bucket_width),
    ]


def downsample_vectors(summaries: list[VectorSummary], bucket_width: int) -> tuple[list[int], np.ndarray]:
    """(first step, worst row) per bucket of steps; summaries in step order, all of one width."""
    width_ = summaries[-1].values.shape[0]
    summaries = [s for s in sorted(summaries, key=lambda s: s.first_step) if s.values.shape[0] == width_]
    buckets = np.array([s.first_step // bucket_width for s in summaries])
    starts = np.flatnonzero(np.diff(buckets, prepend=buckets[0] - 1))
    matrix = np.vstack([s.values for s in summaries])
    return [summaries[i].first_step for i in starts], worst_per_bucket(matrix, starts)


# -- maintenance: one walk up the pyramid for both kinds --------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """How one kind of series is rolled up: group the level below into `groups[(series, bucket)]`,
    and turn a bucket's parts into the stored columns after the key."""

    group_raw: Callable[[dict[tuple[int, int], list[Any]], Executor, list[int], int, int, int], None]
    group_level: Callable[[dict[tuple[int, int], list[Any]], Executor, list[int], int, int, int, int], None]
    merge: Callable[[list[Any]], tuple[Any, ...]]
    table: Any
    columns: tuple[str, ...]


def _refresh(
    kind: _Kind, executor: Executor, rank: int, steps_by_series: Mapping[int, Iterable[int]]
) -> None:
    """Recompute every rollup bucket (all levels) holding one of the given steps, from the level below."""
    touched = {sid: {step // BASE for step in steps} for sid, steps in steps_by_series.items()}
    touched = {sid: buckets for sid, buckets in touched.items() if buckets}
    for level in range(1, LEVELS + 1):
        if not touched:
            return
        series_ids = sorted(touched)
        groups: dict[tuple[int, int], list[Any]] = defaultdict(list)
        for first, last in _intervals(b for buckets in touched.values() for b in buckets):
            lo, hi = first * BASE, (last + 1) * BASE  # in the level below's units
            if level == 1:
                kind.group_raw(groups, executor, series_ids, rank, lo, hi)
            else:
                kind.group_level(groups, executor, series_ids, rank, level - 1, lo, hi)
        rows = [
            (sid, rank, level, bucket, *kind.merge(groups[sid, bucket]))
            for sid, buckets in touched.items()
            for bucket in buckets
            if groups.get((sid, bucket))
        ]
        bulk.upsert(executor, kind.table, kind.columns, _ROLLUP_KEY, rows)
        touched = {sid: {b // BASE for b in buckets} for sid, buckets in touched.items()}


def _point_columns(parts: list[SummaryRow]) -> tuple[Any, ...]:
    s = combine(parts)
    return (s[POINT_COUNT], *s[LOW_STEP:POINT_COUNT])


def _vector_columns(parts: list[VectorSummary]) -> tuple[Any, ...]:
    merged = _merge(parts)
    return merged.count, merged.first_step, to_bytes(merged.values)


def _group_vector_rows(
    groups: dict[tuple[int, int], list[VectorSummary]],
    executor: Executor,
    series_ids: list[int],
    rank: int,
    lo: int,
    hi: int,
) -> None:
    for sid, step, data in _read_vector_rows(executor, series_ids, rank, lo, hi):
        groups[sid, step // BASE].append(VectorSummary(step, 1, to_array(data)))


def _group_vector_rollups(
    groups: dict[tuple[int, int], list[VectorSummary]],
    executor: Executor,
    series_ids: list[int],
    rank: int,
    level: int,
    lo: int,
    hi: int,
) -> None:
    for sid, bucket, first_step, count, data in _read_vector_rollups(
        executor, series_ids, rank, level, lo, hi
    ):
        groups[sid, bucket // BASE].append(VectorSummary(first_step, count, to_array(data)))


def _group_point_rollups(
    groups: dict[tuple[int, int], list[SummaryRow]],
    executor: Executor,
    series_ids: list[int],
    rank: int,
    level: int,
    lo: int,
    hi: int,
) -> None:
    for row in _read_point_rollups(executor, series_ids, rank, level, lo, hi):
        groups[row[0], row[1] // BASE].append(row[2:])


_POINTS = _Kind(
    group_raw=lambda groups, executor, ids, rank, lo, hi: _group_points(
        groups, _read_points(executor, ids, rank, lo, hi), BASE
    ),
    group_level=_group_point_rollups,
    merge=_point_columns,
    table=PointRollup.__table__,
    columns=_POINT_ROLLUP_COLUMNS,
)
_VECTORS = _Kind(
    group_raw=_group_vector_rows,
    group_level=_group_vector_rollups,
    merge=_vector_columns,
    table=VectorRollup.__table__,
    columns=_VECTOR_ROLLUP_COLUMNS,
)


def refresh_points(executor: Executor, rank: int, steps_by_series: Mapping[int, Iterable[int]]) -> None:
    """Recompute the scalar rollups holding the given steps (Store.ingest, after writing points)."""
    _refresh(_POINTS, executor, rank, steps_by_series)


def refresh_vectors(executor: Executor, rank: int, steps_by_series: Mapping[int, Iterable[int]]) -> None:
    """Recompute the per-layer vector rollups holding the given steps."""
    _refresh(_VECTORS, executor, rank, steps_by_series)


# -- maintenance when a batch only adds points --------------------------------------------------------


@dataclass
class _Spans:
    """Summaries of spans of steps as columns, one entry per (series, bucket), in (series, bucket)
    order: what merge_new_points computes for all the buckets of a batch with numpy (a batch holds up
    to hundreds of thousands of points, and a Python object per point or per bucket cost more than
    the database's work). The raw points are spans of one step each."""

    series: np.ndarray
    bucket: np.ndarray
    low_step: np.ndarray
    low_value: np.ndarray  # float64, non-finite values as they are (their flag says which)
    low_flag: np.ndarray
    high_step: np.ndarray
    high_value: np.ndarray
    high_flag: np.ndarray
    count: np.ndarray

    @classmethod
    def of_points(cls, new: Mapping[int, chunked_points.Points]) -> _Spans:
        ids = sorted(sid for sid, points in new.items() if len(points))
        steps = np.concatenate([new[sid].steps for sid in ids])
        values = np.concatenate([new[sid].values for sid in ids])
        flags = chunked_points.flags(values)
        series = np.repeat(np.asarray(ids, dtype=np.int64), [len(new[sid]) for sid in ids])
        ones = np.ones(len(steps), dtype=np.int64)
        return cls(series, steps, steps, values, flags, steps, values, flags, ones)

    @classmethod
    def empty(cls) -> _Spans:
        ints, floats, flags = (np.zeros(0, dtype=t) for t in (np.int64, np.float64, np.int8))
        return cls(ints, ints, ints, floats, flags, ints, floats, flags, ints)

    @classmethod
    def of_rollup_rows(cls, rows: Sequence[tuple[Any, ...]]) -> _Spans:
        """From (series_id, bucket, *Summary fields) rows (a NULL value is non-finite: its flag says how)."""
        if not rows:
            return cls.empty()
        series, bucket, low_step, low_value, low_flag, high_step, high_value, high_flag, count = zip(
            *rows, strict=True
        )
        low_flags = np.asarray(low_flag, dtype=np.int8)
        high_flags = np.asarray(high_flag, dtype=np.int8)
        return cls(
            np.asarray(series, dtype=np.int64),
            np.asarray(bucket, dtype=np.int64),
            np.asarray(low_step, dtype=np.int64),
            _decoded(low_value, low_flags),
            low_flags,
            np.asarray(high_step, dtype=np.int64),
            _decoded(high_value, high_flags),
            high_flags,
            np.asarray(count, dtype=np.int64),
        )

    @classmethod
    def concatenate(cls, parts: Sequence[_Spans]) -> _Spans:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def rebucketed(self, bucket: np.ndarray) -> _Spans:
        """The same summaries with other bucket numbers (what coarser() groups by)."""
        return dataclasses.replace(self, bucket=bucket)

    def coarser(self, factor: int = BASE) -> _Spans:
        """The summaries of the buckets `factor` times wider (a bucket's spans are adjacent, in step order):
        the lowest is the first non-finite one, else the smallest value (earliest on ties); the highest
        the largest finite value (latest on ties), else the lowest again -- as combine() does. Per
        group minima and maxima by reduceat, ties found by position: no sort."""
        bucket = self.bucket // factor
        change = np.ones(len(bucket), dtype=bool)
        change[1:] = (bucket[1:] != bucket[:-1]) | (self.series[1:] != self.series[:-1])
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], len(bucket))
        sizes = ends - starts
        low_finite = self.low_flag == 0
        smallest = np.minimum.reduceat(np.where(low_finite, self.low_value, np.inf), starts)
        low, _ = _first_where(low_finite & (self.low_value == np.repeat(smallest, sizes)), starts, ends)
        first_non_finite, any_non_finite = _first_where(~low_finite, starts, ends)
        low = np.where(any_non_finite, first_non_finite, low)
        high_finite = self.high_flag == 0
        largest = np.maximum.reduceat(np.where(high_finite, self.high_value, -np.inf), starts)
        high, any_finite = _last_where(
            high_finite & (self.high_value == np.repeat(largest, sizes)), starts, ends
        )
        high_step = np.where(any_finite, self.high_step[high], self.low_step[low])
        high_value = np.where(any_finite, self.high_value[high], self.low_value[low])
        high_flag = np.where(any_finite, self.high_flag[high], self.low_flag[low])
        return _Spans(
            self.series[starts],
            bucket[starts],
            self.low_step[low],
            self.low_value[low],
            self.low_flag[low],
            high_step,
            high_value,
            high_flag,
            np.add.reduceat(self.count, starts),
        )

    def rows(self) -> list[SummaryRow]:
        """The summaries as rollup rows' tuples (value None where not finite)."""

        def stored(values: np.ndarray, flags: np.ndarray) -> list[float | None]:
            out: list[float | None] = np.where(flags == 0, values, 0.0).tolist()
            for i in np.flatnonzero(flags).tolist():
                out[i] = None
            return out

        return list(
            zip(
                self.low_step.tolist(),
                stored(self.low_value, self.low_flag),
                self.low_flag.tolist(),
                self.high_step.tolist(),
                stored(self.high_value, self.high_flag),
                self.high_flag.tolist(),
                self.count.tolist(),
                strict=True,
            )
        )


def _decoded(values: Sequence[float | None], flags: np.ndarray) -> np.ndarray:
    """Stored values as floats: NULL (non-finite) as the NaN or ±Inf its flag names."""
    out = np.fromiter((0.0 if v is None else v for v in values), dtype=np.float64, count=len(values))
    out[flags == Flag.NAN] = np.nan
    out[flags == Flag.POS_INF] = np.inf
    out[flags == Flag.NEG_INF] = -np.inf
    return out


def _first_where(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group [start, end): the first index where `mask` holds, and whether there is one (where
    there is none, the index is some valid position)."""
    where = np.flatnonzero(mask)
    if not len(where):
        return starts.copy(), np.zeros(len(starts), dtype=bool)
    at = np.minimum(np.searchsorted(where, starts), len(where) - 1)
    found = where[at]
    ok = (found >= starts) & (found < ends)
    return np.where(ok, found, starts), ok


def _last_where(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group [start, end): the last index where `mask` holds, and whether there is one."""
    where = np.flatnonzero(mask)
    if not len(where):
        return starts.copy(), np.zeros(len(starts), dtype=bool)
    at = np.maximum(np.searchsorted(where, ends) - 1, 0)
    found = where[at]
    ok = (found >= starts) & (found < ends)
    return np.where(ok, found, starts), ok


def merge_new_points(executor: Executor, rank: int, new: Mapping[int, chunked_points.Points]) -> None:
    """Fold points that overwrote nothing (series id -> points) into the pyramid: each touched
    bucket's summary becomes combine(stored summary, the batch's summary), at every level, with one
    read and one write. (The lowest/highest of a union is the lowest/highest of the parts; that
    holds only for new points, so a batch that rewrote steps goes through refresh_points.)"""
    new = {sid: points for sid, points in new.items() if len(points)}
    if not new:
        return
    spans = _Spans.of_points(new)
    batch: dict[tuple[int, int, int], SummaryRow] = {}  # (level, series, bucket) -> summary
    bounds = []
    for level in range(1, LEVELS + 1):
        spans = spans.coarser()
        keys = zip(spans.series.tolist(), spans.bucket.tolist(), strict=True)
        batch.update(
            ((level, sid, bucket), row) for (sid, bucket), row in zip(keys, spans.rows(), strict=True)
        )
        bounds.append((level, int(spans.bucket.min()), int(spans.bucket.max())))
    series_ids = sorted(new)
    # One SELECT per level, joined by UNION ALL: each is an index range scan (an OR of the levels
    # made SQLite scan every stored bucket of these series, a cost that grew with the run).
    selects, params = [], []
    for level, lowest, highest in bounds:
        selects.append(
            f"SELECT level, series_id, bucket, {_SUMMARY_COLUMNS} FROM point_rollups WHERE series_id IN"
            f" ({_in(series_ids)}) AND rank = ? AND level = ? AND bucket >= ? AND bucket <= ?"
        )
        params += [*series_ids, rank, level, lowest, highest]
    stored = bulk.fetch(executor, " UNION ALL ".join(selects), params)
    for level, sid, bucket, *fields in stored:
        mine = batch.get((level, sid, bucket))
        if mine is not None:
            batch[level, sid, bucket] = combine([tuple(fields), mine])
    bulk.upsert(
        executor,
        PointRollup.__table__,
        _POINT_ROLLUP_COLUMNS,
        _ROLLUP_KEY,
        [
            (sid, rank, level, bucket, s[POINT_COUNT], *s[LOW_STEP:POINT_COUNT])
            for (level, sid, bucket), s in batch.items()
        ],
    )


# -- backfill ---------------------------------------------------------------------------------------

_REBUILD_CHUNK = 65_536  # steps per refresh: bounded memory for any series length


def rebuild_all(connection: Connection) -> None:
    """Roll up every stored series (repairs)."""
    for series_id, rank in list(chunked_points.iterate_pairs(connection)):
        refresh_points_of(connection, series_id, rank)
    rebuild_vectors(connection)


def rebuild_vectors(connection: Connection) -> None:
    """Roll up every stored per-layer vector (migration 0004, which introduced rollups)."""
    pairs = connection.execute(select(VectorPoint.series_id, VectorPoint.rank).distinct()).all()
    for series_id, rank in pairs:
        steps = (
            connection.execute(
                select(VectorPoint.step)
                .where(VectorPoint.series_id == series_id, VectorPoint.rank == rank)
                .order_by(VectorPoint.step)
            )
            .scalars()
            .all()
        )
        for start in range(0, len(steps), _REBUILD_CHUNK):
            refresh_vectors(connection, rank, {series_id: steps[start : start + _REBUILD_CHUNK]})


def refresh_points_of(executor: Executor, series_id: int, rank: int) -> None:
    """Recompute every rollup bucket of one (series, rank) from its points, a window at a time."""
    extent = chunked_points.extent(executor, series_id, rank, None, None)
    if extent is None:
        return
    first, last = extent
    for lo in range(first - first % _REBUILD_CHUNK, last + 1, _REBUILD_CHUNK):
        found = chunked_points.read(executor, series_id, [rank], lo, lo + _REBUILD_CHUNK).get(rank)
        if found is not None:
            refresh_points(executor, rank, {series_id: found.steps.tolist()})
