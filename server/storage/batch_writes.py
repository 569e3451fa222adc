"""Writing a batch's data (scalars as point chunks and their rollups, events, per-layer vectors and
histograms) for one rank, in the caller's transaction: what ingest stores after its checks, and what a
restore of a kept attempt (storage.attempts) writes back the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import InvalidRequest
from ..models import Event, HistogramPoint, Run, Series, VectorPoint
from ..schemas import BatchIn, ScalarSeriesIn
from . import bulk, chunked_points, queries, rollups
from .codecs import dump_json, pack

__all__ = ["BatchWriter", "PackedLayerData", "batch_points"]


def batch_points(batch: BatchIn, series_ids: dict[str, int]) -> dict[int, chunked_points.Points]:
    """The batch's scalars as points per series id. A key sent twice in the batch is one series (a
    step repeated for a key keeps its last value)."""
    by_series: dict[int, list[ScalarSeriesIn]] = {}
    for series in batch.scalars:
        by_series.setdefault(series_ids[series.key], []).append(series)
    points = {}
    for sid, parts in by_series.items():
        if len(parts) == 1:
            steps, values = parts[0].steps_array(), parts[0].values_array()
        else:
            steps = np.concatenate([p.steps_array() for p in parts])
            values = np.concatenate([p.values_array() for p in parts])
        points[sid] = chunked_points.Points.of(steps, values)
    return points


@dataclass(frozen=True)
class PackedLayerData:
    """A batch's per-layer vectors and histograms as stored, by (key, step): the last of a repeated
    (key, step) wins, as in the rows written."""

    vectors: dict[tuple[str, int], bytes]
    histograms: dict[tuple[str, int], bytes]

    @classmethod
    def of(cls, batch: BatchIn) -> PackedLayerData:
        return cls(
            {
                (v.key, step): pack(row, "d")
                for v in batch.vectors
                for step, row in zip(v.steps, v.values, strict=True)  # validated to pair up
            },
            {(h.key, h.step): pack([c for row in h.counts for c in row], "q") for h in batch.histograms},
        )


class BatchWriter:
    """Writes batches' data; holds the small chunks ingest merges every few batches."""

    def __init__(self, loose_chunks: chunked_points.LooseChunks) -> None:
        self.loose_chunks = loose_chunks

    def write(
        self, session: Session, run_id: str, batch: BatchIn, packed: PackedLayerData
    ) -> tuple[int, int]:
        """Store the batch's data for its rank; returns (scalar points written, the largest step or -1)."""
        series_ids = self.series_ids(session, run_id, [s.key for s in batch.scalars], "scalar")
        new_points = batch_points(batch, series_ids)
        point_count = sum(map(len, new_points.values()))
        last_step = max((int(p.steps[-1]) for p in new_points.values() if len(p)), default=-1)
        if point_count:
            # Points that overwrite nothing (the normal case: a run moving forward) are folded
            # into the rollups; a series whose stored steps the batch rewrote (a resumed run)
            # has them recomputed.
            rewritten = chunked_points.write(session, batch.rank, new_points, self.loose_chunks)
            rollups.merge_new_points(
                session, batch.rank, {sid: p for sid, p in new_points.items() if sid not in rewritten}
            )
            if rewritten:
                rollups.refresh_points(
                    session, batch.rank, {sid: new_points[sid].steps.tolist() for sid in rewritten}
                )
        if batch.events:
            session.execute(
                Event.__table__.insert(),
                [
                    {
                        "run_id": run_id,
                        "rank": batch.rank,
                        "step": e.step,
                        "kind": e.kind,
                        "data_json": dump_json(e.data),
                    }
                    for e in batch.events
                ],
            )
            last_step = max(last_step, max(e.step for e in batch.events))
        last_step = max(last_step, self._layer_data(session, run_id, batch, packed))
        return point_count, last_step

    def _layer_data(self, session: Session, run_id: str, batch: BatchIn, packed: PackedLayerData) -> int:
        """Store the batch's per-layer vectors and histograms (packed: as packed before the transaction,
        for the steps a resume left of them); returns the largest step (or -1)."""
        if not batch.vectors and not batch.histograms:
            return -1
        layers = batch.layers
        if layers is None:
            layers = json.loads(session.scalar(select(Run.layers_json).where(Run.id == run_id)) or "[]")
        width = len(layers)
        last_step = -1
        for vector in batch.vectors:
            for row in vector.values:
                if width and len(row) != width:
                    raise InvalidRequest(
                        f"vector {vector.key!r} has {len(row)} values per step but the run has {width} layers"
                    )
        for histogram in batch.histograms:
            if width and len(histogram.counts) != width:
                raise InvalidRequest(
                    f"histogram {histogram.key!r} has {len(histogram.counts)} rows but the run has {width} "
                    "layers"
                )
        vector_ids = self.series_ids(session, run_id, [v.key for v in batch.vectors], "vector")
        vector_rows = {
            (vector_ids[v.key], step): packed.vectors[v.key, step] for v in batch.vectors for step in v.steps
        }
        if vector_rows:
            bulk.upsert(
                session,
                VectorPoint.__table__,
                ("series_id", "rank", "step", "data"),
                ("series_id", "rank", "step"),
                [(sid, batch.rank, step, data) for (sid, step), data in vector_rows.items()],
            )
            steps_by_series: dict[int, list[int]] = {}
            for sid, step in vector_rows:
                steps_by_series.setdefault(sid, []).append(step)
            rollups.refresh_vectors(session, batch.rank, steps_by_series)
            last_step = max(step for _, step in vector_rows)
        histogram_ids = self.series_ids(session, run_id, [h.key for h in batch.histograms], "histogram")
        histogram_rows = {
            (histogram_ids[h.key], h.step): (h.exponent_min, h.exponent_max, packed.histograms[h.key, h.step])
            for h in batch.histograms
        }
        if histogram_rows:
            bulk.upsert(
                session,
                HistogramPoint.__table__,
                ("series_id", "rank", "step", "exponent_min", "exponent_max", "counts"),
                ("series_id", "rank", "step"),
                [(sid, batch.rank, step, *fields) for (sid, step), fields in histogram_rows.items()],
            )
            last_step = max([last_step] + [step for _, step in histogram_rows])
        return last_step

    def series_ids(self, session: Session, run_id: str, keys: list[str], kind: str) -> dict[str, int]:
        if not keys:
            return {}
        wanted = sorted(set(keys))
        rows: list[tuple[Any, ...]] = []
        for part in queries.chunks(wanted):
            rows += bulk.execute(
                session,
                'SELECT "key", id, kind FROM series WHERE run_id = ?'
                f' AND "key" IN ({", ".join("?" * len(part))})',
                [run_id, *part],
            )
        if len(rows) < len(wanted):  # new keys (the first batches of a run): insert them, read again
            known = {key for key, _, _ in rows}
            bulk.upsert(
                session,
                Series.__table__,
                ("run_id", "key", "kind"),
                ("run_id", "key"),
                [(run_id, key, kind) for key in wanted if key not in known],
                update=False,
            )
            existing = select(Series.key, Series.id, Series.kind).where(
                Series.run_id == run_id, Series.key.in_(wanted)
            )
            rows = [tuple(row) for row in session.execute(existing).all()]
        clashes = [key for key, _, stored_kind in rows if stored_kind != kind]
        if clashes:
            raise InvalidRequest(f"key {clashes[0]!r} is already used by this run for another kind of data")
        return {key: series_id for key, series_id, _ in rows}
