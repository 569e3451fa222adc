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

The pyramid's shape and the scalar summaries (Summary, combine) are in rollup_summaries, the path
for a batch that only adds points (merge_new_points) in rollup_appends; both are re-exported here.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, select

from ..models import PointRollup, VectorPoint, VectorRollup
from . import bulk, chunked_points
from .rollup_appends import _Spans, merge_new_points
from .rollup_summaries import (
    _POINT_ROLLUP_COLUMNS,
    _ROLLUP_KEY,
    _SUMMARY_COLUMNS,
    _VECTOR_ROLLUP_COLUMNS,
    BASE,
    HIGH_FLAG,
    HIGH_STEP,
    HIGH_VALUE,
    LEVELS,
    LOW_FLAG,
    LOW_STEP,
    LOW_VALUE,
    POINT_COUNT,
    Executor,
    Summary,
    SummaryRow,
    _in,
    combine,
    width,
)

__all__ = [
    "BASE",
    "HIGH_FLAG",
    "HIGH_STEP",
    "HIGH_VALUE",
    "LEVELS",
    "LOW_FLAG",
    "LOW_STEP",
    "LOW_VALUE",
    "POINT_COUNT",
    "Executor",
    "Summary",
    "SummaryRow",
    "VectorSummary",
    "combine",
    "downsample",
    "downsample_vectors",
    "merge_new_points",
    "plan",
    "point_summaries",
    "rebuild_all",
    "rebuild_vectors",
    "refresh_points",
    "refresh_points_of",
    "refresh_vectors",
    "to_array",
    "to_bytes",
    "vector_summaries",
    "width",
    "worst_per_bucket",
]

# Buckets further apart than this are refreshed with separate range reads; closer ones with one read.
_MAX_GAP_BUCKETS = 64


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
    """Rows of `matrix` (in step order) grouped at `starts`: per column, the group's first NaN, else its
    first other non-finite value, else its largest. NaN first: an update ratio's +inf only says the
    weights were zero (drawn blank), its NaN is the alarm (red) that must not hide behind it. One
    vectorised pass; the rare non-finite cells are fixed up one by one."""
    bad = ~np.isfinite(matrix)
    merged = np.maximum.reduceat(np.where(bad, -np.inf, matrix), starts, axis=0)
    if bad.any():
        ends = np.append(starts[1:], len(matrix))
        for group, column in zip(*np.nonzero(np.logical_or.reduceat(bad, starts, axis=0)), strict=True):
            rows = starts[group] + np.flatnonzero(bad[starts[group] : ends[group], column])
            values = matrix[rows, column]
            nans = np.flatnonzero(np.isnan(values))
            merged[group, column] = values[nans[0]] if len(nans) else values[0]
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
