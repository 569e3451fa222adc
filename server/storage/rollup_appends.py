"""Rollup maintenance when a batch only adds points: merge_new_points folds them into every level of
the scalar pyramid with one read and one write (gradwatch.server.storage.rollups re-exports it).

The lowest and highest point of a union of spans are the lowest and highest of its parts, so a
batch that overwrote nothing need not recompute its buckets from the level below (refresh_points):
_Spans holds the batch's summaries per (series, bucket) as numpy columns, coarsened level by level,
and each is combined with the stored summary of its bucket. A batch that rewrote steps goes through
refresh_points instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models import Flag, PointRollup
from . import bulk, chunked_points
from .rollup_summaries import (
    _POINT_ROLLUP_COLUMNS,
    _ROLLUP_KEY,
    _SUMMARY_COLUMNS,
    BASE,
    LEVELS,
    LOW_STEP,
    POINT_COUNT,
    Executor,
    SummaryRow,
    _in,
    combine,
)


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
