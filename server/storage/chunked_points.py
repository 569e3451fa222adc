"""Scalar points stored in chunks: one row holds up to MAX_CHUNK_POINTS consecutive points of one
(series, rank), their steps and values as compressed arrays (the layout of Prometheus' TSDB,
TimescaleDB's compression and InfluxDB).

Why: one row and one index entry per point cost more than everything else ingest does (SQLite's
executemany of (series, rank, step) rows alone took a third of a batch's time, PostgreSQL more), and a
training run's points arrive in step order, a batch at a time, which chunks fit exactly.

Invariants, kept by every writer here:
- the chunks of one (series, rank) cover disjoint step intervals [first_step, last_step]; within a
  chunk steps ascend and are unique, so a (series, rank, step) has at most one value, as before;
- a step written again replaces its value (a resumed run re-logs old steps): write() merges the
  chunks the new points overlap with them and stores the result in their place.

Sizes: a batch's points of a series form one chunk (split at MAX_CHUNK_POINTS). Small chunks (fewer
than TOP_UP_BELOW points) at the end of a series are merged with the next batch's points of the
series when they come after them, so a run that logs a point a second still ends up with chunks of
hundreds of points, not rows of one. Without a LooseChunks, write() merges them on every batch (the
tail is read, decoded, deleted and written again: at 20 steps a batch each point is rewritten ~12
times); with one (the Store's), a batch appends its points as a chunk of their own and the tail is
merged on every COMPACT_EVERY-th batch of a series only: at most about that many small chunks end a
series, and each point is rewritten a few times at most.

Encoding (reversible, NaN payloads and ±Inf kept): steps as int64 differences from the first step,
values as float64. A chunk of TOP_UP_BELOW points or more is deflated (zlib level 1), its values'
bytes grouped by significance first (all first bytes, then all second bytes…: the exponent bytes of
a series are alike and compress well); a smaller one, rewritten by each top-up, is stored plain. A
leading byte names the codec, so another can be added without a migration.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ..models import Flag, PointChunk
from . import bulk
from .codecs import decode_float

__all__ = [
    "COMPACT_EVERY",
    "MAX_CHUNK_POINTS",
    "TOP_UP_BELOW",
    "LooseChunks",
    "Points",
    "concat",
    "count_and_max_before",
    "decode",
    "delete_from",
    "extent",
    "flags",
    "iterate_pairs",
    "last_step",
    "latest",
    "read",
    "read_after",
    "read_first",
    "rows",
    "write",
]

MAX_CHUNK_POINTS = 4096
TOP_UP_BELOW = 512
COMPACT_EVERY = 16  # with a LooseChunks: a series' small tail chunks are merged every this many batches

Executor = Session | Connection
# The first byte of step_data and value_data: how the rest is stored (int64 step differences,
# float64 values; deflated: the values' bytes grouped by significance first, zlib level 1).
_PLAIN = b"\x00"
_DEFLATED = b"\x01"
_COLUMNS = ("series_id", "rank", "first_step", "last_step", "count", "step_data", "value_data")
_STORED = "first_step, last_step, count, step_data, value_data"  # what a reader decodes


@dataclass(frozen=True)
class Points:
    """Points of one (series, rank) in step order: steps int64, unique and ascending; values float64."""

    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray) -> Points:
        """Points from a batch's lists (or arrays): sorted by step; a repeated step keeps its last value."""
        s = np.asarray(steps, dtype=np.int64)
        v = np.asarray(values, dtype=np.float64)
        if len(s) > 1 and not bool(np.all(s[1:] > s[:-1])):
            # The last occurrence of each step wins: unique over the reversed arrays finds it.
            reverse_steps = s[::-1]
            unique, first_in_reverse = np.unique(reverse_steps, return_index=True)
            s, v = unique, v[::-1][first_in_reverse]
        return cls(s, v)

    @classmethod
    def of_stored(cls, stored: Sequence[Sequence[Any]]) -> Points:
        """Points from (step, value, flag) rows in step order, as the points table held them."""
        values = [decode_float(value, flag) for _, value, flag in stored]
        return cls(
            np.asarray([row[0] for row in stored], dtype=np.int64), np.asarray(values, dtype=np.float64)
        )

    @classmethod
    def empty(cls) -> Points:
        return cls(np.empty(0, np.int64), np.empty(0, np.float64))

    def __len__(self) -> int:
        return len(self.steps)

    def between(self, start: int | None, end: int | None) -> Points:
        """The points with start <= step < end (None: open)."""
        lo = 0 if start is None else int(np.searchsorted(self.steps, start, "left"))
        hi = len(self.steps) if end is None else int(np.searchsorted(self.steps, end, "left"))
        return self if (lo, hi) == (0, len(self.steps)) else Points(self.steps[lo:hi], self.values[lo:hi])

    def replaced_by(self, newer: Points) -> Points:
        """These points with `newer`'s added, newer winning at a step both hold."""
        if not len(self):
            return newer
        if len(newer) and newer.steps[0] > self.steps[-1]:  # the usual top-up: newer comes after
            return concat([self, newer])
        kept = ~np.isin(self.steps, newer.steps, assume_unique=True)
        steps = np.concatenate([self.steps[kept], newer.steps])
        order = np.argsort(steps, kind="stable")
        return Points(steps[order], np.concatenate([self.values[kept], newer.values])[order])


def concat(parts: Sequence[Points]) -> Points:
    """Points of step-ordered, disjoint parts, in order."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return Points.empty()
    return Points(np.concatenate([p.steps for p in parts]), np.concatenate([p.values for p in parts]))


def flags(values: np.ndarray) -> np.ndarray:
    """The models.Flag of each value (FINITE, NAN, POS_INF, NEG_INF), as int8."""
    out = np.zeros(len(values), dtype=np.int8)
    out[np.isnan(values)] = Flag.NAN
    out[values == np.inf] = Flag.POS_INF
    out[values == -np.inf] = Flag.NEG_INF
    return out


def rows(points: Points) -> list[tuple[int, float | None, int]]:
    """(step, value, flag) tuples as the points table stored them (value None when not finite)."""
    values: list[float | None] = points.values.tolist()
    marks = flags(points.values)
    if marks.any():
        for i in np.flatnonzero(marks).tolist():
            values[i] = None
    return list(zip(points.steps.tolist(), values, marks.tolist(), strict=True))


# -- encoding ---------------------------------------------------------------------------------------


def _encode(points: Points) -> tuple[bytes, bytes]:
    """(step_data, value_data) of a chunk: deflated when it holds TOP_UP_BELOW points or more; a
    smaller one (a tail that later batches top up, rewritten each time) is stored plain, since a
    zlib call costs tens of microseconds before it compresses anything."""
    deltas = np.empty(len(points.steps), dtype="<i8")
    deltas[0] = 0
    np.subtract(points.steps[1:], points.steps[:-1], out=deltas[1:])
    if len(points) < TOP_UP_BELOW:
        return _PLAIN + deltas.tobytes(), _PLAIN + points.values.astype("<f8").tobytes()
    grouped = points.values.astype("<f8").view(np.uint8).reshape(-1, 8).T
    return (
        _DEFLATED + zlib.compress(deltas.tobytes(), 1),
        _DEFLATED + zlib.compress(np.ascontiguousarray(grouped).tobytes(), 1),
    )


def decode(first_step: int, step_data: bytes, value_data: bytes) -> Points:
    """The points of a stored chunk row (its first_step, step_data and value_data columns)."""
    step_data, value_data = bytes(step_data), bytes(value_data)  # psycopg gives memoryviews
    codec = step_data[:1]
    if codec != value_data[:1] or codec not in (_PLAIN, _DEFLATED):
        raise ValueError(f"point chunk at step {first_step} has an unknown encoding")
    if codec == _PLAIN:
        deltas = np.frombuffer(step_data, dtype="<i8", offset=1)
        values = np.frombuffer(value_data, dtype="<f8", offset=1)
    else:
        deltas = np.frombuffer(zlib.decompress(step_data[1:]), dtype="<i8")
        grouped = np.frombuffer(zlib.decompress(value_data[1:]), dtype=np.uint8).reshape(8, -1)
        values = np.ascontiguousarray(grouped.T).view("<f8").reshape(-1)
    steps = np.cumsum(deltas, dtype=np.int64)
    steps += first_step
    return Points(steps, values.astype(np.float64, copy=False))


def _decoded(row: Sequence[Any]) -> Points:
    """Points of a row read as (..., first_step, last_step, count, step_data, value_data)."""
    first_step, _last, _count, step_data, value_data = row[-5:]
    return decode(first_step, step_data, value_data)


def _chunk_rows(series_id: int, rank: int, points: Points) -> list[tuple[Any, ...]]:
    out = []
    for lo in range(0, len(points), MAX_CHUNK_POINTS):
        piece = Points(points.steps[lo : lo + MAX_CHUNK_POINTS], points.values[lo : lo + MAX_CHUNK_POINTS])
        step_data, value_data = _encode(piece)
        first, last = int(piece.steps[0]), int(piece.steps[-1])
        out.append((series_id, rank, first, last, len(piece), step_data, value_data))
    return out


def _in(items: Sequence[Any]) -> str:
    return ", ".join("?" for _ in items)


_KEY = ("series_id", "rank", "first_step")


# -- writing ----------------------------------------------------------------------------------------


class LooseChunks:
    """How many chunks each (series, rank) had appended since its tail was last merged, in this process
    (write() with it appends instead of merging on every batch). Only the layout depends on it, never
    what is stored: a count lost (a restart, another replica writing the same series, a transaction
    rolled back after counting) merely moves the next merge, which takes every small chunk at the
    end of the series whatever the count said."""

    def __init__(self, every: int = COMPACT_EVERY, capacity: int = 1_000_000) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.every = every
        self.capacity = capacity  # (series, rank) counts kept at most; beyond, all start over
        self._appended: dict[tuple[int, int], int] = {}

    def due(self, series_ids: Sequence[int], rank: int) -> set[int]:
        """Count one batch for each series; the ones whose tail is to be merged by this batch."""
        if len(self._appended) + len(series_ids) > self.capacity:
            self._appended.clear()
        due = set()
        for sid in series_ids:
            key = (sid, rank)
            count = self._appended.get(key, 0) + 1
            if count >= self.every:
                due.add(sid)
                count = 0
            self._appended[key] = count
        return due


def write(
    executor: Executor, rank: int, new: Mapping[int, Points], loose: LooseChunks | None = None
) -> set[int]:
    """Store a batch's points of one rank (series id -> points); returns the series whose stored
    points the batch overlapped (a step written again, or new steps between stored ones): their
    rollups must be recomputed, the others' can be folded (rollups.merge_new_points). With `loose`,
    points after everything stored are appended as chunks of their own, and a series' small tail
    chunks merged only when `loose` says so (see the module docstring)."""
    new = {sid: points for sid, points in new.items() if len(points)}
    if not new:
        return set()
    ids = sorted(new)
    lo = min(int(points.steps[0]) for points in new.values())
    overlapping: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for row in bulk.fetch(
        executor,
        f"SELECT series_id, {_STORED} FROM point_chunks"
        f" WHERE series_id IN ({_in(ids)}) AND rank = ? AND last_step >= ?",
        [*ids, rank, lo],
    ):
        points = new[row[0]]
        if row[1] <= points.steps[-1] and row[2] >= points.steps[0]:
            overlapping[row[0]].append(row)
    appended = [sid for sid in ids if sid not in overlapping]
    if loose is None:  # the tail of every series is merged with its new points, unless they are many
        merged = [sid for sid in appended if len(new[sid]) < TOP_UP_BELOW]
    else:  # only when due; and before a bigger chunk, which would leave the small ones behind it
        due = loose.due(appended, rank)
        merged = [sid for sid in appended if sid in due or len(new[sid]) >= TOP_UP_BELOW]
    tails = _small_tails(executor, rank, merged)
    deletes: list[tuple[int, int, int]] = []
    inserts: list[tuple[Any, ...]] = []
    for sid in ids:
        points = new[sid]
        stored = overlapping.get(sid) or tails.get(sid)
        if stored:
            stored.sort(key=lambda row: row[1])
            points = concat([_decoded(row) for row in stored]).replaced_by(points)
            deletes.extend((sid, rank, row[1]) for row in stored)
        inserts.extend(_chunk_rows(sid, rank, points))
    bulk.delete_keys(executor, PointChunk.__table__, _KEY, deletes)
    bulk.insert(executor, PointChunk.__table__, _COLUMNS, inserts)
    return set(overlapping)


def _small_tails(executor: Executor, rank: int, series_ids: list[int]) -> dict[int, list[tuple[Any, ...]]]:
    """The chunks at the end of each series that hold fewer than TOP_UP_BELOW points (those after
    its last bigger chunk; at most about LooseChunks.every of them): one statement, per series one
    backward index walk to its last bigger chunk and a range scan after it."""
    if not series_ids:
        return {}
    found = bulk.fetch(
        executor,
        f"WITH wanted(sid) AS (VALUES {', '.join('(?)' for _ in series_ids)})"
        f" SELECT c.series_id, c.{_STORED.replace(', ', ', c.')} FROM wanted JOIN point_chunks c"
        " ON c.series_id = wanted.sid AND c.rank = ? AND c.first_step > COALESCE((SELECT m.first_step"
        " FROM point_chunks m WHERE m.series_id = wanted.sid AND m.rank = ? AND m.count >= ?"
        " ORDER BY m.first_step DESC LIMIT 1), -1)",
        [*series_ids, rank, rank, TOP_UP_BELOW],
    )
    tails: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for row in found:
        tails[row[0]].append(row)
    return dict(tails)


def delete_from(executor: Executor, series_ids: Sequence[int], rank: int, step: int) -> None:
    """Remove the rank's points at `step` and after (a resume supersedes them)."""
    if not series_ids:
        return
    ids = list(series_ids)
    found = bulk.fetch(
        executor,
        f"SELECT series_id, {_STORED} FROM point_chunks"
        f" WHERE series_id IN ({_in(ids)}) AND rank = ? AND last_step >= ?",
        [*ids, rank, step],
    )
    bulk.delete_keys(executor, PointChunk.__table__, _KEY, [(row[0], rank, row[1]) for row in found])
    kept = [(row[0], _decoded(row).between(None, step)) for row in found if row[1] < step]
    bulk.insert(
        executor,
        PointChunk.__table__,
        _COLUMNS,
        [chunk for sid, points in kept for chunk in _chunk_rows(sid, rank, points)],
    )


# -- reading ----------------------------------------------------------------------------------------


def _where(
    series_id: int, ranks: Sequence[int] | None, start: int | None, end: int | None
) -> tuple[str, list[Any]]:
    """WHERE clause and parameters: chunks of the series (and ranks) holding steps in [start, end)."""
    sql, params = "series_id = ?", [series_id]
    if ranks is not None:
        sql += f" AND rank IN ({_in(ranks)})"
        params += list(ranks)
    if start is not None:
        sql, params = sql + " AND last_step >= ?", [*params, start]
    if end is not None:
        sql, params = sql + " AND first_step < ?", [*params, end]
    return sql, params


def read(
    executor: Executor,
    series_id: int,
    ranks: Sequence[int] | None = None,
    start: int | None = None,
    end: int | None = None,
) -> dict[int, Points]:
    """Each rank's points with start <= step < end (ranks None: every rank), ranks without any left out."""
    if ranks is not None and not ranks:
        return {}
    where, params = _where(series_id, ranks, start, end)
    parts: dict[int, list[Points]] = defaultdict(list)
    for row in bulk.fetch(
        executor, f"SELECT rank, {_STORED} FROM point_chunks WHERE {where} ORDER BY rank, first_step", params
    ):
        parts[row[0]].append(_decoded(row))
    found = {rank: concat(pieces).between(start, end) for rank, pieces in parts.items()}
    return {rank: points for rank, points in found.items() if len(points)}


def read_first(
    executor: Executor, series_id: int, rank: int, start: int | None, end: int | None, limit: int
) -> Points:
    """The first `limit` points with start <= step < end, reading only the chunks needed."""
    where, params = _where(series_id, [rank], start, end)
    parts: list[Points] = []
    count = 0
    for row in bulk.fetch_lazily(
        executor, f"SELECT {_STORED} FROM point_chunks WHERE {where} ORDER BY first_step", params, size=8
    ):
        piece = _decoded(row).between(start, end)
        parts.append(piece)
        count += len(piece)
        if count >= limit:
            break
    points = concat(parts)
    return Points(points.steps[:limit], points.values[:limit])


def read_after(
    executor: Executor, pairs: Mapping[tuple[int, int], int], limit: int
) -> tuple[dict[tuple[int, int], Points], bool]:
    """Points after a step of each (series, rank) -> step, in step order, at most `limit` in all; True
    when more were waiting. One statement per few hundred pairs (OR-ed index range probes)."""
    found: dict[tuple[int, int], Points] = {}
    total = 0
    items = sorted(pairs.items())
    for lo in range(0, len(items), 200):
        piece = items[lo : lo + 200]
        where = " OR ".join("(series_id = ? AND rank = ? AND last_step > ?)" for _ in piece)
        params = [value for (sid, rank), after in piece for value in (sid, rank, after)]
        parts: dict[tuple[int, int], list[Points]] = defaultdict(list)
        for row in bulk.fetch(
            executor,
            f"SELECT series_id, rank, {_STORED} FROM point_chunks WHERE {where}"
            " ORDER BY series_id, rank, first_step",
            params,
        ):
            parts[row[0], row[1]].append(_decoded(row))
        for pair, chunks in parts.items():
            points = concat(chunks).between(pairs[pair] + 1, None)
            if total + len(points) > limit:
                keep = limit - total
                if keep > 0:
                    found[pair] = Points(points.steps[:keep], points.values[:keep])
                return found, True
            if len(points):
                found[pair] = points
                total += len(points)
    return found, False


def latest(executor: Executor, series_id: int, rank: int, at: int) -> tuple[int, float] | None:
    """The (step, value) of the last point at or before step `at`: one backward index seek."""
    row = bulk.fetch(
        executor,
        f"SELECT {_STORED} FROM point_chunks WHERE series_id = ? AND rank = ? AND first_step <= ?"
        " ORDER BY first_step DESC LIMIT 1",
        [series_id, rank, at],
    )
    if not row:
        return None
    points = _decoded(row[0]).between(None, at + 1)
    return int(points.steps[-1]), float(points.values[-1])


def extent(
    executor: Executor, series_id: int, rank: int, start: int | None, end: int | None
) -> tuple[int, int] | None:
    """First and last stored step in [start, end): two index seeks (chunk intervals are disjoint, so
    the chunk ending first at or after `start` holds the first step, and the one starting last
    before `end` the last)."""
    where, params = _where(series_id, [rank], start, None)
    first_row = bulk.fetch(
        executor, f"SELECT {_STORED} FROM point_chunks WHERE {where} ORDER BY last_step LIMIT 1", params
    )
    if not first_row:
        return None
    first_points = _decoded(first_row[0]).between(start, end)
    if not len(first_points):
        return None
    where, params = _where(series_id, [rank], None, end)
    last_row = bulk.fetch(
        executor, f"SELECT {_STORED} FROM point_chunks WHERE {where} ORDER BY first_step DESC LIMIT 1", params
    )
    last_points = _decoded(last_row[0]).between(start, end)
    return int(first_points.steps[0]), int(last_points.steps[-1])


def last_step(executor: Executor, series_id: int, rank: int) -> int | None:
    """The (series, rank)'s last stored step: one backward index seek."""
    found = bulk.fetch(
        executor,
        "SELECT max(last_step) FROM point_chunks WHERE series_id = ? AND rank = ?",
        [series_id, rank],
    )
    return None if found[0][0] is None else int(found[0][0])


def count_and_max_before(
    executor: Executor, series_id: int, rank: int, before: int
) -> tuple[int, float | None]:
    """How many points precede step `before`, and the largest finite value among them (None: none)."""
    points = read(executor, series_id, [rank], None, before).get(rank, Points.empty())
    finite = points.values[np.isfinite(points.values)]
    return len(points), float(finite.max()) if len(finite) else None


def iterate_pairs(executor: Executor) -> Iterator[tuple[int, int]]:
    """Every stored (series, rank)."""
    yield from (
        (int(sid), int(rank))
        for sid, rank in bulk.fetch(executor, "SELECT DISTINCT series_id, rank FROM point_chunks", [])
    )
