"""The Store's series queries: the keys of a run, one key's points, per-layer vectors and
histograms (gradwatch.server.storage.store delegates to SeriesReads).

Each query runs in one of the Store's transactions (passed in, so errors are translated the same
way) and reads a long series through the rollups (gradwatch.server.storage.rollups) when it holds
more steps than asked for, so its cost does not grow with the run's length. The results are the
frozen SeriesResult, VectorsResult and HistogramsResult, which the storage package re-exports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..errors import NotFound
from ..models import HistogramPoint, Series, VectorPoint
from . import chunked_points, queries, rollups
from .codecs import unpack


@dataclass(frozen=True)
class SeriesResult:
    steps: list[int]
    values: list[float]
    downsampled: bool


@dataclass(frozen=True)
class VectorsResult:
    layers: list[str]
    steps: list[int]
    values: list[list[float]]
    downsampled: bool


@dataclass(frozen=True)
class HistogramsResult:
    exponents: list[int]
    steps: list[int]
    counts: list[list[int]]
    zeros: list[int]
    non_finite: list[int]


class SeriesReads:
    """Series, per-layer vectors and histograms of a run, each read one snapshot (Transactions.reading)."""

    def __init__(self, transaction: Callable[[], AbstractContextManager[Session]]) -> None:
        self._transaction = transaction

    def keys(self, run_id: str, kind: str = "scalar") -> list[str]:
        with self._transaction() as session:
            queries.require_run(session, run_id)
            return list(
                session.scalars(
                    select(Series.key)
                    .where(Series.run_id == run_id, Series.kind == kind)
                    .order_by(Series.key)
                )
            )

    def vectors(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> VectorsResult:
        """Per-layer rows of one key with start <= step < end. With more than max_steps rows, steps
        are grouped into at most max_steps equal buckets keeping, per layer, the first non-finite
        value or else the largest (read from the rollups: cost independent of the run's length)."""
        with self._transaction() as session:
            run = queries.require_run(session, run_id)
            layers = json.loads(run.layers_json)
            series_id = queries.series_id(session, run_id, key)
            extent = (
                None if series_id is None else self._extent(session, VectorPoint, series_id, rank, start, end)
            )
            if series_id is None or extent is None:
                return VectorsResult(layers, [], [], downsampled=False)
            first, last = extent
            if last - first + 1 > max_steps:
                level, bucket_width = rollups.plan(first, last, max_steps)
                summaries = rollups.vector_summaries(
                    session, series_id, rank, first, last + 1, level, bucket_width
                )
                if sum(s.count for s in summaries) > max_steps:
                    steps, matrix = rollups.downsample_vectors(summaries, bucket_width)
                    return VectorsResult(layers, steps, matrix.tolist(), downsampled=True)
            rows = session.execute(
                select(VectorPoint.step, VectorPoint.data)
                .where(
                    VectorPoint.series_id == series_id,
                    VectorPoint.rank == rank,
                    VectorPoint.step >= first,
                    VectorPoint.step <= last,
                )
                .order_by(VectorPoint.step)
            ).all()
        return VectorsResult(
            layers, [row.step for row in rows], [unpack(row.data, "d") for row in rows], False
        )

    def histograms(
        self, run_id: str, key: str, layer: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> HistogramsResult:
        """One layer's log2 histograms over steps (evenly thinned to at most max_steps snapshots).
        Only the chosen snapshots are read, and of each only the layer's slice of the counts."""
        with self._transaction() as session:
            run = queries.require_run(session, run_id)
            layers = json.loads(run.layers_json)
            if layer not in layers:
                raise NotFound(f"layer {layer!r} is not one of the run's {len(layers)} layers")
            index = layers.index(layer)
            series_id = queries.series_id(session, run_id, key)
            in_series = (HistogramPoint.series_id == series_id, HistogramPoint.rank == rank)
            steps = session.scalars(
                queries.step_range(
                    select(HistogramPoint.step).where(*in_series), HistogramPoint.step, start, end
                ).order_by(HistogramPoint.step)
            ).all()
            if len(steps) > max_steps:
                steps = [steps[i * len(steps) // max_steps] for i in range(max_steps)]
            width = HistogramPoint.exponent_max - HistogramPoint.exponent_min + 3  # bins, zeros, NaN/Inf
            points = (
                session.execute(
                    select(
                        HistogramPoint.step,
                        HistogramPoint.exponent_min,
                        HistogramPoint.exponent_max,
                        func.substr(HistogramPoint.counts, index * width * 8 + 1, width * 8).label("row"),
                    )
                    .where(*in_series, HistogramPoint.step.in_(steps))
                    .order_by(HistogramPoint.step)
                ).all()
                if steps
                else []
            )
        exponent_min = points[0].exponent_min if points else 0
        exponent_max = points[0].exponent_max if points else -1
        counts, zeros, non_finite = [], [], []
        for point in points:
            row = unpack(bytes(point.row), "q")
            counts.append(row[:-2])
            zeros.append(row[-2])
            non_finite.append(row[-1])
        return HistogramsResult(
            list(range(exponent_min, exponent_max + 1)), [p.step for p in points], counts, zeros, non_finite
        )

    def series(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> SeriesResult:
        """Points of one key with start <= step < end. Beyond max_points, max_points // 2 equal step
        buckets keep their lowest and highest point (a non-finite point counts as the lowest), so a
        one-step spike survives any zoom; read from the rollups, so a 10M-point series costs about
        as much as a 10k-point one."""
        with self._transaction() as session:
            queries.require_run(session, run_id)
            series_id = queries.series_id(session, run_id, key)
            extent = (
                None if series_id is None else chunked_points.extent(session, series_id, rank, start, end)
            )
            if series_id is None or extent is None:
                return SeriesResult([], [], downsampled=False)
            first, last = extent
            if last - first + 1 > max_points:
                level, bucket_width = rollups.plan(first, last, max_points // 2)
                summaries = rollups.point_summaries(
                    session, series_id, rank, first, last + 1, level, bucket_width
                )
                steps, values, total = rollups.downsample(summaries, bucket_width)
                if total > max_points:
                    return SeriesResult(steps, values, downsampled=True)
            points = chunked_points.read(session, series_id, [rank], first, last + 1).get(rank)
        if points is None:
            return SeriesResult([], [], False)
        return SeriesResult(points.steps.tolist(), points.values.tolist(), False)

    @staticmethod
    def _extent(
        session: Session, model: Any, series_id: int, rank: int, start: int | None, end: int | None
    ) -> tuple[int, int] | None:
        """First and last stored step of a series in [start, end): two index seeks, no scan."""
        query = queries.step_range(
            select(model.step).where(model.series_id == series_id, model.rank == rank), model.step, start, end
        )
        first = session.scalar(query.order_by(model.step).limit(1))
        if first is None:
            return None
        return first, session.scalar(query.order_by(model.step.desc()).limit(1))
