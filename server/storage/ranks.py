"""The ranks of a distributed run, and their values combined at query time.

Every rank of a distributed job reports into the same run under its own rank (points are keyed by
(series, rank, step)); the agent adds no collective to the training loop, so nothing is combined
before the data arrives here. What each rank is (host, local rank, world size, how its gradients are
laid out, how it ended) comes from its "rank" events, merged in order.

Combining one key over the ranks, step by step, only at steps that every rank reporting the key has
reached (the newest steps of a live run appear once the slowest rank's batch has arrived) and, for
l2 and sum over shards, that every rank of the job has reached (a missing shard would make the sum
silently small):
    l2     sqrt(sum of squares): the global norm from the shards' norms of sharded gradients (FSDP)
    sum    additive quantities (throughput, counts of sharded histograms)
    mean, min, max
    auto   l2 for the norm keys (grad/global_norm, grad/norm, param/norm) of a run whose gradients
           are sharded, else mean (replicated DDP norms are equal on every rank and never summed)
A NaN on any rank makes the combined value NaN; an infinity makes it infinite (l2, sum, mean, max).
The per-rank values stay available next to the combined one, so a diverging rank stands out.

RankReads (Store.ranks) answers these questions, each call in a session of its own that only reads;
gradwatch.server.routers.ranks serves them over HTTP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from ..database import snapshot_session
from ..errors import InvalidRequest, NotFound
from ..models import AgentBatch, Event, HistogramPoint, VectorPoint
from . import chunked_points, queries
from .codecs import unpack

__all__ = [
    "COMBINES",
    "NORM_KEYS",
    "CombinedHistograms",
    "CombinedSeries",
    "CombinedVectors",
    "Disagreement",
    "RankInfo",
    "RankReads",
    "RanksSummary",
    "resolve_combine",
]

COMBINES = ("auto", "l2", "sum", "mean", "min", "max")
NORM_KEYS = frozenset({"grad/global_norm", "grad/global_norm_post_clip", "grad/norm", "param/norm"})
RANK_EVENT = "rank"
SKIPPED_KEY = "amp/skipped"
SHARDED = "sharded"


@dataclass(frozen=True)
class RankInfo:
    """One rank as the run knows it. Fields a rank did not report are None."""

    rank: int
    host: str | None = None
    local_rank: int | None = None
    world_size: int | None = None
    pid: int | None = None
    parallelism: str | None = None
    gradients: str | None = None  # sharded | replicated | hybrid | local
    histograms: bool | None = None  # whether this rank takes gradient histograms
    status: str | None = None  # how the rank ended (finished | crashed), None while it runs
    batches: int = 0
    last_seen: float | None = None  # seconds since the epoch of its newest batch


@dataclass(frozen=True)
class RanksSummary:
    world_size: int
    gradients: str  # the layout every rank reported, "mixed" if they differ, "local" if none did
    ranks: list[RankInfo]


@dataclass(frozen=True)
class CombinedSeries:
    key: str
    combine: str  # the mode applied ("auto" resolved)
    ranks: list[int]  # the ranks whose values were combined
    steps: list[int]
    values: list[float]
    per_rank: dict[int, list[float]]  # each rank's value at each of `steps`
    downsampled: bool


@dataclass(frozen=True)
class CombinedVectors:
    key: str
    combine: str
    ranks: list[int]
    layers: list[str]
    steps: list[int]
    values: list[list[float]]
    downsampled: bool


@dataclass(frozen=True)
class CombinedHistograms:
    key: str
    layer: str
    combine: str  # "sum" (sharded gradients) or "first" (the lowest rank's counts)
    ranks: list[int]
    exponents: list[int]
    steps: list[int]
    counts: list[list[int]]
    zeros: list[int]
    non_finite: list[int]


@dataclass(frozen=True)
class Disagreement:
    """A step some ranks skipped (amp/skipped = 1) while others applied it."""

    step: int
    skipped_ranks: list[int]
    applied_ranks: list[int]
    layers: list[str] = field(default_factory=list)  # non-finite layers named by the skipping ranks


class RankReads:
    """The ranks of distributed runs, read only: each call a session of its own, one snapshot.

    NotFound names an unknown run or layer, InvalidRequest an unknown combine mode or a key holding
    another kind of data."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def rank_summary(self, run_id: str) -> RanksSummary:
        """Every rank that sent anything to the run or announced itself, with what it reported."""
        with snapshot_session(self.engine) as session:
            return _rank_summary(session, run_id)

    def combined_series(
        self,
        run_id: str,
        key: str,
        combine: str = "auto",
        start: int | None = None,
        end: int | None = None,
        max_points: int = 2000,
    ) -> CombinedSeries:
        """One scalar key combined over the ranks for start <= step < end (see the module docstring)."""
        with snapshot_session(self.engine) as session:
            return _combined_series(session, run_id, key, combine, start, end, max_points)

    def combined_vectors(
        self,
        run_id: str,
        key: str,
        combine: str = "auto",
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 500,
    ) -> CombinedVectors:
        """A per-layer key combined over the ranks, layer by layer, as a step x layer matrix."""
        with snapshot_session(self.engine) as session:
            return _combined_vectors(session, run_id, key, combine, start, end, max_steps)

    def combined_histograms(
        self,
        run_id: str,
        layer: str,
        key: str = "grad/hist",
        combine: str = "auto",
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 200,
    ) -> CombinedHistograms:
        """One layer's log2|g| histograms over the ranks (summed for sharded gradients)."""
        with snapshot_session(self.engine) as session:
            return _combined_histograms(session, run_id, layer, key, combine, start, end, max_steps)

    def disagreements(
        self, run_id: str, start: int | None = None, end: int | None = None, limit: int = 1000
    ) -> tuple[list[Disagreement], int]:
        """Steps skipped on some ranks but applied on others, oldest first, and how many there are."""
        with snapshot_session(self.engine) as session:
            return _disagreements(session, run_id, start, end, limit)


# -- the ranks of a run ------------------------------------------------------------------------------


def _rank_documents(session: Session, run_id: str) -> dict[int, dict[str, Any]]:
    """Each rank's "rank" events merged in step order (later fields win)."""
    merged: dict[int, dict[str, Any]] = {}
    rows = session.execute(
        select(Event.rank, Event.data_json)
        .where(Event.run_id == run_id, Event.kind == RANK_EVENT)
        .order_by(Event.step, Event.id)
    )
    for rank, data_json in rows:
        try:
            data = json.loads(data_json)
        except ValueError:
            continue
        if isinstance(data, dict):
            merged.setdefault(rank, {}).update(data)
    return merged


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _rank_summary(session: Session, run_id: str) -> RanksSummary:
    """Every rank that sent anything to the run or announced itself, with what it reported."""
    run = queries.require_run(session, run_id)
    documents = _rank_documents(session, run_id)
    activity = {
        rank: (count, last_seen)
        for rank, count, last_seen in session.execute(
            select(AgentBatch.rank, func.count(), func.max(AgentBatch.received_at))
            .where(AgentBatch.run_id == run_id)
            .group_by(AgentBatch.rank)
        )
    }
    ranks = []
    for rank in sorted(set(documents) | set(activity)):
        document = documents.get(rank, {})
        batches, last_seen = activity.get(rank, (0, None))
        histograms = document.get("histograms")
        ranks.append(
            RankInfo(
                rank=rank,
                host=_str_or_none(document.get("host")),
                local_rank=_int_or_none(document.get("local_rank")),
                world_size=_int_or_none(document.get("world_size")),
                pid=_int_or_none(document.get("pid")),
                parallelism=_str_or_none(document.get("parallelism")),
                gradients=_str_or_none(document.get("gradients")),
                histograms=histograms if isinstance(histograms, bool) else None,
                status=_str_or_none(document.get("status")),
                batches=batches,
                last_seen=last_seen,
            )
        )
    try:
        metadata_world = _int_or_none(json.loads(run.metadata_json).get("world_size")) or 1
    except (ValueError, AttributeError):
        metadata_world = 1
    world_size = max([metadata_world, len(ranks)] + [r.world_size for r in ranks if r.world_size])
    layouts = {r.gradients for r in ranks if r.gradients is not None}
    gradients = layouts.pop() if len(layouts) == 1 else ("mixed" if layouts else "local")
    return RanksSummary(world_size, gradients, ranks)


def resolve_combine(combine: str, key: str, gradients: str) -> str:
    """The mode "auto" stands for with this key and layout (see the module docstring); others as given.

    InvalidRequest names an unknown mode."""
    if combine not in COMBINES:
        raise InvalidRequest(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")
    if combine != "auto":
        return combine
    return "l2" if key in NORM_KEYS and gradients == SHARDED else "mean"


def _expected_ranks(summary: RanksSummary, mode: str, reporting: list[int]) -> int:
    """How many ranks a step needs before it is combined: every rank reporting the key, and for a
    sum over shards every rank of the job (a missing shard would make the sum silently small)."""
    if mode in ("l2", "sum") and summary.gradients == SHARDED:
        return max(len(reporting), summary.world_size)
    return len(reporting)


# -- scalar series -----------------------------------------------------------------------------------


def _combine_scalars(
    mode: str,
    n: int,
    square_sum: float | None,
    total: float | None,
    low: float | None,
    high: float | None,
    nans: int,
    pos: int,
    neg: int,
) -> float:
    """One step's combined value from SQL aggregates over its n ranks (finite values only in the sums)."""
    if nans or (pos and neg and mode in ("sum", "mean")):
        return math.nan
    if mode == "l2":
        return math.inf if pos or neg else math.sqrt(square_sum or 0.0)
    if mode in ("sum", "mean"):
        if pos or neg:
            return math.inf if pos else -math.inf
        return (total or 0.0) if mode == "sum" else (total or 0.0) / n
    if mode == "min":
        return -math.inf if neg else (low if low is not None else math.inf)
    return math.inf if pos else (high if high is not None else -math.inf)  # max


def _is_lower(a: float, b: float) -> bool:
    """Ordering for downsampling: a non-finite value ranks lowest, as in the store's downsampler."""
    if not math.isfinite(a):
        return math.isfinite(b)
    return math.isfinite(b) and a < b


def _combined_series(
    session: Session,
    run_id: str,
    key: str,
    combine: str = "auto",
    start: int | None = None,
    end: int | None = None,
    max_points: int = 2000,
) -> CombinedSeries:
    """One scalar key combined over the ranks for start <= step < end (see the module docstring).

    More than max_points combined steps are downsampled: max_points // 2 equal step buckets keep the
    steps of their lowest and highest combined value (a non-finite one counts as the lowest)."""
    summary = _rank_summary(session, run_id)
    mode = resolve_combine(combine, key, summary.gradients)
    series_id = queries.series_id(session, run_id, key, "scalar")
    if series_id is None:
        return CombinedSeries(key, mode, [], [], [], {}, downsampled=False)
    found = chunked_points.read(session, series_id, None, start, end)
    if not found:
        return CombinedSeries(key, mode, [], [], [], {}, downsampled=False)
    ranks = sorted(found)
    first = min(int(found[rank].steps[0]) for rank in ranks)
    last = max(int(found[rank].steps[-1]) for rank in ranks)
    all_values = np.concatenate([found[rank].values for rank in ranks])
    steps_at, inverse, counts = np.unique(
        np.concatenate([found[rank].steps for rank in ranks]), return_inverse=True, return_counts=True
    )
    # Per step over its ranks, as SQL aggregates would give them: sums, min and max of the finite
    # values (±inf where there are none, which _combine_scalars reads as "no finite value").
    finite = np.isfinite(all_values)
    finite_values = np.where(finite, all_values, 0.0)
    size = len(steps_at)
    square_sum = np.bincount(inverse, weights=finite_values * finite_values, minlength=size)
    total = np.bincount(inverse, weights=finite_values, minlength=size)
    low = np.full(size, np.inf)
    np.minimum.at(low, inverse, np.where(finite, all_values, np.inf))
    high = np.full(size, -np.inf)
    np.maximum.at(high, inverse, np.where(finite, all_values, -np.inf))
    nans = np.bincount(inverse, weights=np.isnan(all_values), minlength=size)
    pos = np.bincount(inverse, weights=all_values == np.inf, minlength=size)
    neg = np.bincount(inverse, weights=all_values == -np.inf, minlength=size)
    complete = np.flatnonzero(counts == _expected_ranks(summary, mode, ranks)).tolist()
    step_list, n, sq, tot, lo, hi, na, po, ne = (
        a.tolist() for a in (steps_at, counts, square_sum, total, low, high, nans, pos, neg)
    )
    combined = (
        (step_list[i], _combine_scalars(mode, n[i], sq[i], tot[i], lo[i], hi[i], na[i], po[i], ne[i]))
        for i in complete
    )
    downsampled = max(len(found[rank]) for rank in ranks) > max_points
    points = _min_max_buckets(combined, first, last, max_points) if downsampled else list(combined)
    steps = [step for step, _ in points]
    wanted = np.asarray(steps, dtype=np.int64)
    per_rank: dict[int, list[float]] = {}
    for rank in ranks:
        stored = found[rank]
        at = np.searchsorted(stored.steps, wanted).clip(0, max(len(stored) - 1, 0))
        present = stored.steps[at] == wanted if len(stored) else np.zeros(len(wanted), bool)
        per_rank[rank] = np.where(present, stored.values[at], np.nan).tolist()
    return CombinedSeries(key, mode, ranks, steps, [v for _, v in points], per_rank, downsampled)


def _min_max_buckets(
    points: Iterable[tuple[int, float]], first: int, last: int, max_points: int
) -> list[tuple[int, float]]:
    """Stream (step, value) in step order into max_points // 2 equal step buckets, keeping each
    bucket's lowest and highest point in step order."""
    buckets = max(1, max_points // 2)
    width = max(1, -(-(last - first + 1) // buckets))
    kept: list[tuple[int, float]] = []
    current = None
    low = high = (0, 0.0)
    for step, value in points:
        bucket = (step - first) // width
        if bucket != current:
            if current is not None:
                kept.extend(sorted({low, high}))
            current, low, high = bucket, (step, value), (step, value)
            continue
        if _is_lower(value, low[1]):
            low = (step, value)
        if math.isfinite(value) and (not math.isfinite(high[1]) or value > high[1]):
            high = (step, value)
    if current is not None:
        kept.extend(sorted({low, high}))
    return kept


# -- per-layer vectors -------------------------------------------------------------------------------


def _combine_rows(mode: str, rows: list[list[float]]) -> list[float]:
    """Combine the ranks' rows of one step, layer by layer (NaN anywhere gives NaN)."""
    out = []
    for column in zip(*rows, strict=False):  # rows of different widths: the layers they all have
        if any(math.isnan(v) for v in column):
            out.append(math.nan)
            continue
        pos, neg = math.inf in column, -math.inf in column
        finite = [v for v in column if math.isfinite(v)]
        out.append(
            _combine_scalars(
                mode,
                len(column),
                math.fsum(v * v for v in finite),
                math.fsum(finite),
                min(finite) if finite else None,
                max(finite) if finite else None,
                0,
                int(pos),
                int(neg),
            )
        )
    return out


def _worst(values: Iterable[float]) -> float:
    """A heatmap cell of several steps: the first non-finite value, else the largest."""
    largest = -math.inf
    for value in values:
        if not math.isfinite(value):
            return value
        largest = max(largest, value)
    return largest


def _combined_vectors(
    session: Session,
    run_id: str,
    key: str,
    combine: str = "auto",
    start: int | None = None,
    end: int | None = None,
    max_steps: int = 500,
) -> CombinedVectors:
    """A per-layer key combined over the ranks, layer by layer, as a step x layer matrix; more than
    max_steps steps are merged into equal step buckets keeping per layer the first non-finite value
    or else the largest (as the single-rank heatmap does)."""
    run = queries.require_run(session, run_id)
    layers = json.loads(run.layers_json)
    summary = _rank_summary(session, run_id)
    mode = resolve_combine(combine, key, summary.gradients)
    series_id = queries.series_id(session, run_id, key, "vector")
    if series_id is None:
        return CombinedVectors(key, mode, [], layers, [], [], downsampled=False)
    query = queries.step_range(
        select(VectorPoint.step, VectorPoint.rank, VectorPoint.data).where(
            VectorPoint.series_id == series_id
        ),
        VectorPoint.step,
        start,
        end,
    )
    ranks = sorted(session.scalars(select(query.subquery().c.rank).distinct()))
    by_step: dict[int, dict[int, list[float]]] = {}
    for step, rank, data in session.execute(query.order_by(VectorPoint.step)):
        by_step.setdefault(step, {})[rank] = unpack(data, "d")
    expected = _expected_ranks(summary, mode, ranks)
    steps = [step for step, rows in sorted(by_step.items()) if len(rows) == expected]
    matrix = [_combine_rows(mode, [by_step[step][rank] for rank in ranks]) for step in steps]
    if len(steps) <= max_steps:
        return CombinedVectors(key, mode, ranks, layers, steps, matrix, downsampled=False)
    merged_steps, merged = [], []
    n = len(steps)
    for b in range(max_steps):
        lo, hi = b * n // max_steps, (b + 1) * n // max_steps
        if lo < hi:
            merged_steps.append(steps[lo])
            merged.append([_worst(column) for column in zip(*matrix[lo:hi], strict=False)])
    return CombinedVectors(key, mode, ranks, layers, merged_steps, merged, downsampled=True)


# -- histograms --------------------------------------------------------------------------------------


def _combined_histograms(
    session: Session,
    run_id: str,
    layer: str,
    key: str = "grad/hist",
    combine: str = "auto",
    start: int | None = None,
    end: int | None = None,
    max_steps: int = 200,
) -> CombinedHistograms:
    """One layer's log2|g| histograms over the ranks: "sum" adds the ranks' counts (exact for sharded
    gradients, whose shards together are the whole gradient); "first" takes the lowest rank's (for
    replicated gradients, whose ranks count the same values); "auto" picks by the run's layout.
    Steps are thinned evenly to at most max_steps."""
    if combine not in ("auto", "sum", "first"):
        raise InvalidRequest(f"combine must be one of auto, sum, first for histograms, got {combine!r}")
    run = queries.require_run(session, run_id)
    layers = json.loads(run.layers_json)
    if layer not in layers:
        raise NotFound(f"layer {layer!r} is not one of the run's {len(layers)} layers")
    index = layers.index(layer)
    summary = _rank_summary(session, run_id)
    mode = combine if combine != "auto" else ("sum" if summary.gradients == SHARDED else "first")
    series_id = queries.series_id(session, run_id, key, "histogram")
    empty = CombinedHistograms(key, layer, mode, [], [], [], [], [], [])
    if series_id is None:
        return empty
    query = queries.step_range(
        select(HistogramPoint).where(HistogramPoint.series_id == series_id), HistogramPoint.step, start, end
    )
    points = session.scalars(query.order_by(HistogramPoint.step, HistogramPoint.rank)).all()
    if not points:
        return empty
    ranks = sorted({p.rank for p in points})
    if mode == "first":
        ranks = ranks[:1]
    by_step: dict[int, dict[int, Any]] = {}
    for point in points:
        if point.rank in ranks:
            by_step.setdefault(point.step, {})[point.rank] = point
    expected = _expected_ranks(summary, mode, ranks) if mode == "sum" else 1
    steps = [step for step, found in sorted(by_step.items()) if len(found) == expected]
    if len(steps) > max_steps:
        steps = [steps[i * len(steps) // max_steps] for i in range(max_steps)]
    exponent_min, exponent_max = points[0].exponent_min, points[0].exponent_max
    width = exponent_max - exponent_min + 3
    counts, zeros, non_finite = [], [], []
    for step in steps:
        total = [0] * width
        for point in by_step[step].values():
            if (point.exponent_min, point.exponent_max) != (exponent_min, exponent_max):
                raise InvalidRequest(
                    f"step {step}: ranks used different histogram bins; they cannot be added"
                )
            row = unpack(point.counts, "q")[index * width : (index + 1) * width]
            total = [a + b for a, b in zip(total, row, strict=False)]
        counts.append(total[:-2])
        zeros.append(total[-2])
        non_finite.append(total[-1])
    return CombinedHistograms(
        key, layer, mode, ranks, list(range(exponent_min, exponent_max + 1)), steps, counts, zeros, non_finite
    )


# -- rank disagreement -------------------------------------------------------------------------------


def _disagreements(
    session: Session, run_id: str, start: int | None = None, end: int | None = None, limit: int = 1000
) -> tuple[list[Disagreement], int]:
    """Steps skipped (amp/skipped) on some ranks but applied on others, oldest first, and how many
    there are in the range before `limit`."""
    queries.require_run(session, run_id)
    series_id = queries.series_id(session, run_id, SKIPPED_KEY, "scalar")
    if series_id is None:
        return [], 0
    found = chunked_points.read(session, series_id, None, start, end)
    ranks = sorted(found)
    all_steps = np.concatenate([found[rank].steps for rank in ranks]) if ranks else np.empty(0, np.int64)
    all_ranks = np.concatenate([np.full(len(found[rank]), rank) for rank in ranks]) if ranks else all_steps
    skipped = (
        np.concatenate([found[rank].values >= 0.5 for rank in ranks]) if ranks else np.empty(0, bool)
    )  # NaN compares False: a non-finite reading counts as applied, as before
    steps_at, inverse, counts = np.unique(all_steps, return_inverse=True, return_counts=True)
    skipped_count = np.bincount(inverse, weights=skipped, minlength=len(steps_at))
    mixed = (counts > 1) & (skipped_count > 0) & (skipped_count < counts)
    total = int(mixed.sum())
    steps = steps_at[mixed][:limit].tolist()
    shown = np.flatnonzero(np.isin(all_steps, steps))
    shown = shown[np.lexsort((all_ranks[shown], all_steps[shown]))]
    found_at: dict[int, Disagreement] = {}
    for step, rank, skip in zip(
        all_steps[shown].tolist(), all_ranks[shown].tolist(), skipped[shown].tolist(), strict=True
    ):
        entry = found_at.setdefault(step, Disagreement(step, [], []))
        (entry.skipped_ranks if skip else entry.applied_ranks).append(rank)
    for chunk in queries.chunks(steps):
        events = session.execute(
            select(Event.step, Event.data_json)
            .where(Event.run_id == run_id, Event.kind == "skip", Event.step.in_(chunk))
            .order_by(Event.step, Event.rank)
        )
        for step, data_json in events:
            names = json.loads(data_json).get("non_finite_layers") or []
            layers = found_at[step].layers
            layers.extend(str(name) for name in names if str(name) not in layers)
    return [found_at[step] for step in steps], total
