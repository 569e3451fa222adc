"""Persistence: the Store owns every transaction (commit on success, rollback and translate otherwise).

Routers call Store methods with validated schemas and get plain results back; no SQLAlchemy object
leaves this module.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, case, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .database import Transactions
from .errors import Conflict, InvalidRequest, NotFound
from .models import AgentBatch, Event, Flag, HistogramPoint, Point, Run, Series, VectorPoint
from .schemas import BatchIn, RunIn, json_float

_FLAG_VALUES = {Flag.NAN: math.nan, Flag.POS_INF: math.inf, Flag.NEG_INF: -math.inf}
SCALE_KEY = "amp/scale"


def encode_float(value: float) -> tuple[float | None, int]:
    """(value column, flag column) for a float: non-finite values are stored as NULL plus a flag."""
    if math.isfinite(value):
        return value, Flag.FINITE
    if math.isnan(value):
        return None, Flag.NAN
    return None, Flag.POS_INF if value > 0 else Flag.NEG_INF


def decode_float(value: float | None, flag: int) -> float:
    if flag == Flag.FINITE and value is not None:
        return value
    return _FLAG_VALUES.get(Flag(flag), math.nan)


def pack(values: list[float] | list[int], typecode: str) -> bytes:
    """Little-endian bytes of a float64 ("d") or int64 ("q") array: compact, portable, NaN-preserving."""
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes, typecode: str) -> list[Any]:
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else json_float(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def dump_json(document: dict[str, Any]) -> str:
    """Standard JSON text for a free-form document; NaN/±Inf become "NaN"/"Infinity"/"-Infinity"."""
    return json.dumps(_json_safe(document), allow_nan=False, default=str)


@dataclass(frozen=True)
class RunRecord:
    id: str
    project: str
    name: str
    status: str
    created_at: float
    updated_at: float
    last_step: int | None
    config: dict[str, Any]
    metadata: dict[str, Any]
    skips: int
    scale: float | None


@dataclass(frozen=True)
class IngestResult:
    duplicate: bool
    points: int
    events: int


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


def _worst(values: tuple[float, ...]) -> float:
    for value in values:
        if not math.isfinite(value):
            return value
    return max(values)


def _bucket_width(first: int, last: int, max_points: int) -> int:
    return (last - first) // max(max_points // 2, 1) + 1


def _min_max_per_bucket_sqlite(session: Session, points: Any, first: int, last: int, max_points: int) -> list[Any]:
    """The same selection as _min_max_per_bucket in three single-pass GROUP BY queries: SQLite returns
    the other columns of the row that holds a bare MIN()/MAX() (documented behaviour), which avoids
    the window functions' per-bucket sort."""
    bucket = (points.c.step - first) // _bucket_width(first, last, max_points)
    finite = points.c.flag == Flag.FINITE
    lows = session.execute(
        select(bucket, points.c.step, func.min(points.c.value), points.c.flag).where(finite).group_by(bucket)
    ).all()
    highs = session.execute(
        select(bucket, points.c.step, func.max(points.c.value), points.c.flag).where(finite).group_by(bucket)
    ).all()
    non_finite = session.execute(
        select(bucket, func.min(points.c.step), points.c.value, points.c.flag).where(~finite).group_by(bucket)
    ).all()
    chosen = {b: (step, value, flag) for b, step, value, flag in lows}
    chosen.update({b: (step, value, flag) for b, step, value, flag in non_finite})  # NaN/Inf over the minimum
    kept = set(chosen.values()) | {(step, value, flag) for _, step, value, flag in highs}
    return [_Row(step, value, flag) for step, value, flag in sorted(kept, key=lambda row: row[0])]


@dataclass(frozen=True)
class _Row:
    step: int
    value: float | None
    flag: int


def _min_max_per_bucket(points: Any, first: int, last: int, max_points: int) -> Any:
    """SELECT of each step bucket's minimum and maximum point (window functions: SQLite and
    PostgreSQL), in step order. Non-finite points (flag != 0) rank first for the minimum's place."""
    bucket = ((points.c.step - first) // _bucket_width(first, last, max_points)).label("bucket")
    non_finite_first = case((points.c.flag != Flag.FINITE, 0), else_=1)
    ranked = select(
        points.c.step,
        points.c.value,
        points.c.flag,
        func.row_number()
        .over(partition_by=bucket, order_by=(non_finite_first, points.c.value.asc(), points.c.step))
        .label("low_rank"),
        func.row_number()
        .over(partition_by=bucket, order_by=(points.c.flag != Flag.FINITE, points.c.value.desc(), points.c.step))
        .label("high_rank"),
    ).subquery()
    return (
        select(ranked.c.step, ranked.c.value, ranked.c.flag)
        .where(or_(ranked.c.low_rank == 1, ranked.c.high_rank == 1))
        .order_by(ranked.c.step)
    )


def _step_range(query: Any, column: Any, start: int | None, end: int | None) -> Any:
    if start is not None:
        query = query.where(column >= start)
    if end is not None:
        query = query.where(column < end)
    return query


@dataclass(frozen=True)
class EventRecord:
    step: int
    kind: str
    rank: int
    data: dict[str, Any]


class Store:
    """All reads and writes of gradwatch's database, on SQLite or PostgreSQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._transaction = Transactions(engine)  # commit on success, roll back on any error
        dialect = engine.dialect.name
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        # Called with (session, run_id, batch) for each newly stored batch, inside its transaction
        # (the alert engine): evaluation happens exactly once per batch, or not at all if ingest fails.
        self.after_ingest: list[Callable[[Session, str, BatchIn], None]] = []
        # Called with (run_id, batch) after a newly stored batch has committed (live streams):
        # must be quick and must not raise; the data is already durable.
        self.after_commit: list[Callable[[str, BatchIn], None]] = []

    # -- runs -------------------------------------------------------------------------------------

    def create_run(self, run: RunIn) -> RunRecord:
        """Create a run, or return the existing one with the same id (agents retry; ranks share ids)."""
        now = time.time()
        run_id = run.id or uuid.uuid4().hex
        with self._transaction() as session:
            stmt = (
                self._insert(Run)
                .values(
                    id=run_id,
                    project=run.project,
                    name=run.name or run_id[:8],
                    status="running",
                    config_json=dump_json(run.config),
                    metadata_json=dump_json(run.metadata),
                    created_at=now,
                    updated_at=now,
                )
                .on_conflict_do_nothing(index_elements=["id"])
            )
            session.execute(stmt)
            existing = session.get(Run, run_id)
            assert existing is not None
            if existing.project != run.project:
                raise Conflict(
                    f"run {run_id!r} already exists in project {existing.project!r}, "
                    f"not {run.project!r}"
                )
            return self._run_record(session, existing)

    def get_run(self, run_id: str) -> RunRecord:
        with self._transaction() as session:
            return self._run_record(session, self._require_run(session, run_id))

    def list_runs(self, project: str | None, limit: int, offset: int) -> tuple[list[RunRecord], int]:
        """Runs, newest first, and how many match before limit/offset."""
        with self._transaction() as session:
            query = select(Run)
            if project is not None:
                query = query.where(Run.project == project)
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = session.scalars(
                query.order_by(Run.created_at.desc(), Run.id).limit(limit).offset(offset)
            ).all()
            return [self._run_record(session, run) for run in rows], total

    def delete_run(self, run_id: str) -> None:
        with self._transaction() as session:
            self._require_run(session, run_id)
            series_ids = select(Series.id).where(Series.run_id == run_id)
            for table in (Point, VectorPoint, HistogramPoint):
                session.execute(delete(table).where(table.series_id.in_(series_ids)))
            for table in (Series, Event, AgentBatch):
                session.execute(delete(table).where(table.run_id == run_id))
            session.execute(delete(Run).where(Run.id == run_id))

    # -- ingest -----------------------------------------------------------------------------------

    def ingest(self, run_id: str, batch: BatchIn) -> IngestResult:
        """Store one agent batch in one transaction, exactly once per (run, rank, seq)."""
        now = time.time()
        with self._transaction() as session:
            self._require_run(session, run_id)
            claimed = session.execute(
                self._insert(AgentBatch)
                .values(run_id=run_id, rank=batch.rank, seq=batch.seq, received_at=now)
                .on_conflict_do_nothing()
                .returning(AgentBatch.seq)
            ).first()
            if claimed is None:
                return IngestResult(duplicate=True, points=0, events=0)

            series_ids = self._series_ids(session, run_id, [s.key for s in batch.scalars], "scalar")
            point_rows = []
            last_step = -1
            for series in batch.scalars:
                series_id = series_ids[series.key]
                for step, value in zip(series.steps, series.values):
                    stored, flag = encode_float(value)
                    point_rows.append(
                        {"series_id": series_id, "rank": batch.rank, "step": step, "value": stored, "flag": flag}
                    )
                    last_step = max(last_step, step)
            if point_rows:
                upsert = self._insert(Point)
                upsert = upsert.on_conflict_do_update(
                    index_elements=["series_id", "rank", "step"],
                    set_={"value": upsert.excluded.value, "flag": upsert.excluded.flag},
                )
                session.execute(upsert, point_rows)
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
            last_step = max(last_step, self._ingest_layer_data(session, run_id, batch))
            values: dict[str, Any] = {"updated_at": now}
            if batch.layers is not None:
                values["layers_json"] = json.dumps(batch.layers)
            if last_step >= 0:
                if session.get_bind().dialect.name == "sqlite":
                    # SQLite spells the two-argument maximum max(); PostgreSQL spells it greatest().
                    values["last_step"] = func.max(func.coalesce(Run.last_step, -1), last_step)
                else:
                    values["last_step"] = func.greatest(func.coalesce(Run.last_step, -1), last_step)
            if batch.status is not None:
                values["status"] = batch.status
            session.execute(update(Run).where(Run.id == run_id).values(**values))
            for hook in self.after_ingest:
                hook(session, run_id, batch)
            result = IngestResult(duplicate=False, points=len(point_rows), events=len(batch.events))
        for notify in self.after_commit:
            notify(run_id, batch)
        return result

    def _ingest_layer_data(self, session: Session, run_id: str, batch: BatchIn) -> int:
        """Store the batch's per-layer vectors and histograms; returns the largest step (or -1)."""
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
                    f"histogram {histogram.key!r} has {len(histogram.counts)} rows but the run has {width} layers"
                )
        vector_ids = self._series_ids(session, run_id, [v.key for v in batch.vectors], "vector")
        rows = [
            {"series_id": vector_ids[v.key], "rank": batch.rank, "step": step, "data": pack(row, "d")}
            for v in batch.vectors
            for step, row in zip(v.steps, v.values)
        ]
        if rows:
            upsert = self._insert(VectorPoint)
            session.execute(
                upsert.on_conflict_do_update(
                    index_elements=["series_id", "rank", "step"], set_={"data": upsert.excluded.data}
                ),
                rows,
            )
            last_step = max(row["step"] for row in rows)
        histogram_ids = self._series_ids(session, run_id, [h.key for h in batch.histograms], "histogram")
        rows = [
            {
                "series_id": histogram_ids[h.key], "rank": batch.rank, "step": h.step,
                "exponent_min": h.exponent_min, "exponent_max": h.exponent_max,
                "counts": pack([c for row in h.counts for c in row], "q"),
            }
            for h in batch.histograms
        ]
        if rows:
            upsert = self._insert(HistogramPoint)
            session.execute(
                upsert.on_conflict_do_update(
                    index_elements=["series_id", "rank", "step"],
                    set_={name: getattr(upsert.excluded, name) for name in ("exponent_min", "exponent_max", "counts")},
                ),
                rows,
            )
            last_step = max([last_step] + [row["step"] for row in rows])
        return last_step

    def _series_ids(self, session: Session, run_id: str, keys: list[str], kind: str) -> dict[str, int]:
        if not keys:
            return {}
        wanted = sorted(set(keys))
        session.execute(
            self._insert(Series).on_conflict_do_nothing(index_elements=["run_id", "key"]),
            [{"run_id": run_id, "key": key, "kind": kind} for key in wanted],
        )
        rows = session.execute(
            select(Series.key, Series.id, Series.kind).where(Series.run_id == run_id, Series.key.in_(wanted))
        ).all()
        clashes = [key for key, _, stored_kind in rows if stored_kind != kind]
        if clashes:
            raise InvalidRequest(f"key {clashes[0]!r} is already used by this run for another kind of data")
        return {key: series_id for key, series_id, _ in rows}

    # -- queries ----------------------------------------------------------------------------------

    def keys(self, run_id: str, kind: str = "scalar") -> list[str]:
        with self._transaction() as session:
            self._require_run(session, run_id)
            return list(
                session.scalars(
                    select(Series.key).where(Series.run_id == run_id, Series.kind == kind).order_by(Series.key)
                )
            )

    def vectors(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> VectorsResult:
        """Per-layer rows of one key with start <= step < end; more than max_steps steps are merged
        into buckets keeping, per layer, the first non-finite value or else the largest."""
        with self._transaction() as session:
            run = self._require_run(session, run_id)
            query = (
                select(VectorPoint.step, VectorPoint.data)
                .join(Series, Series.id == VectorPoint.series_id)
                .where(Series.run_id == run_id, Series.key == key, VectorPoint.rank == rank)
            )
            query = _step_range(query, VectorPoint.step, start, end)
            rows = session.execute(query.order_by(VectorPoint.step)).all()
            layers = json.loads(run.layers_json)
        steps = [row.step for row in rows]
        matrix = [unpack(row.data, "d") for row in rows]
        if len(rows) <= max_steps:
            return VectorsResult(layers, steps, matrix, downsampled=False)
        merged_steps, merged = [], []
        n = len(rows)
        for b in range(max_steps):
            lo, hi = b * n // max_steps, (b + 1) * n // max_steps
            if lo == hi:
                continue
            merged_steps.append(steps[lo])
            merged.append([_worst(column) for column in zip(*matrix[lo:hi])])
        return VectorsResult(layers, merged_steps, merged, downsampled=True)

    def histograms(
        self, run_id: str, key: str, layer: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> HistogramsResult:
        """One layer's log2 histograms over steps (evenly thinned to at most max_steps snapshots)."""
        with self._transaction() as session:
            run = self._require_run(session, run_id)
            layers = json.loads(run.layers_json)
            if layer not in layers:
                raise NotFound(f"layer {layer!r} is not one of the run's {len(layers)} layers")
            index = layers.index(layer)
            query = (
                select(HistogramPoint)
                .join(Series, Series.id == HistogramPoint.series_id)
                .where(Series.run_id == run_id, Series.key == key, HistogramPoint.rank == rank)
            )
            query = _step_range(query, HistogramPoint.step, start, end)
            points = session.scalars(query.order_by(HistogramPoint.step)).all()
            if len(points) > max_steps:
                points = [points[i * len(points) // max_steps] for i in range(max_steps)]
            exponent_min = points[0].exponent_min if points else 0
            exponent_max = points[0].exponent_max if points else -1
            steps, counts, zeros, non_finite = [], [], [], []
            for point in points:
                width = point.exponent_max - point.exponent_min + 3
                row = unpack(point.counts, "q")[index * width : (index + 1) * width]
                steps.append(point.step)
                counts.append(row[:-2])
                zeros.append(row[-2])
                non_finite.append(row[-1])
        return HistogramsResult(list(range(exponent_min, exponent_max + 1)), steps, counts, zeros, non_finite)

    def series(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> SeriesResult:
        """Points of one key with start <= step < end; more than max_points are downsampled in the
        database: max_points // 2 equal step buckets keep their minimum and maximum (a non-finite
        point takes the minimum's place), so a one-step spike survives any zoom."""
        with self._transaction() as session:
            self._require_run(session, run_id)
            series_id = session.scalar(select(Series.id).where(Series.run_id == run_id, Series.key == key))
            if series_id is None:
                return SeriesResult([], [], downsampled=False)
            in_range = _step_range(
                select(Point.step, Point.value, Point.flag).where(Point.series_id == series_id, Point.rank == rank),
                Point.step, start, end,
            ).subquery()
            count, first, last = session.execute(
                select(func.count(), func.min(in_range.c.step), func.max(in_range.c.step))
            ).one()
            if count <= max_points:
                rows = session.execute(select(in_range).order_by(in_range.c.step)).all()
                downsampled = False
            else:
                if session.get_bind().dialect.name == "sqlite":
                    rows = _min_max_per_bucket_sqlite(session, in_range, first, last, max_points)
                else:
                    rows = session.execute(_min_max_per_bucket(in_range, first, last, max_points)).all()
                downsampled = True
        return SeriesResult(
            [row.step for row in rows], [decode_float(row.value, row.flag) for row in rows], downsampled
        )

    def events(
        self, run_id: str, kind: str | None, start: int | None, end: int | None, limit: int
    ) -> tuple[list[EventRecord], int]:
        with self._transaction() as session:
            self._require_run(session, run_id)
            query = select(Event).where(Event.run_id == run_id)
            if kind is not None:
                query = query.where(Event.kind == kind)
            query = _step_range(query, Event.step, start, end)
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = session.scalars(query.order_by(Event.step, Event.id).limit(limit)).all()
            return [EventRecord(e.step, e.kind, e.rank, json.loads(e.data_json)) for e in rows], total

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _require_run(session: Session, run_id: str) -> Run:
        run = session.get(Run, run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} does not exist")
        return run

    @staticmethod
    def _run_record(session: Session, run: Run) -> RunRecord:
        skips = session.scalar(
            select(func.count()).where(Event.run_id == run.id, Event.kind == "skip")
        ) or 0
        scale_row = session.execute(
            select(Point.value, Point.flag)
            .join(Series, Series.id == Point.series_id)
            .where(Series.run_id == run.id, Series.key == SCALE_KEY, Point.rank == 0)
            .order_by(Point.step.desc())
            .limit(1)
        ).first()
        return RunRecord(
            id=run.id,
            project=run.project,
            name=run.name,
            status=run.status,
            created_at=run.created_at,
            updated_at=run.updated_at,
            last_step=run.last_step,
            config=json.loads(run.config_json),
            metadata=json.loads(run.metadata_json),
            skips=skips,
            scale=decode_float(scale_row.value, scale_row.flag) if scale_row else None,
        )
