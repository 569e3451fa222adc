"""The wire format between agent and server: JSON documents, non-finite floats as strings.

A batch is one JSON object: its identity ("rank", "seq": the server stores a (run, rank, seq) once) and
its data fields ("scalars", "events", and what Resolved.wire_fields adds: "vectors", "histograms",
"layers"), plus an optional run "status". When the server is slower than the flushes, the sender
merges the data of several flushes into one batch before giving it a seq (merge_fragments); a batch
larger than a server takes is cut into consecutive step ranges (split_by_steps, halve_by_steps).
"""

from __future__ import annotations

import base64
import json
import math
import operator
import sys
import threading
import time
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import chain, islice
from typing import Any

# Scalar keys the agent adds about itself (queued/sent/spooled/dropped points); not counted as points.
HEALTH_PREFIX = "agent/"
# Data fields merge_fragments knows how to combine; a fragment with any other field travels alone.
_MERGEABLE = frozenset({"scalars", "vectors", "histograms", "events", "layers", "status"})


def wire_float(value: float) -> float | str:
    """A float for the wire: finite as a number, else "NaN" / "Infinity" / "-Infinity"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def json_safe(obj: Any) -> Any:
    """Make a document strict-JSON safe (floats via wire_float, unknown objects via str)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return wire_float(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return str(obj)


def dumps(document: dict[str, Any]) -> str:
    """Compact strict JSON of a batch, encoded one list item at a time.

    json.dumps holds the GIL for the whole call (~3 µs per float here), so one call on a 50,000-point
    batch would stall the training thread for ~150 ms; item by item, the interpreter can switch
    threads between items.
    """
    parts = []
    for key, value in document.items():
        name = json.dumps(key)
        if isinstance(value, list) and len(value) > 1:
            items = ",".join([json.dumps(item, allow_nan=False, separators=(",", ":")) for item in value])
            parts.append(f"{name}:[{items}]")
        else:
            parts.append(f"{name}:{json.dumps(value, allow_nan=False, separators=(',', ':'))}")
    return "{" + ",".join(parts) + "}"


def batch_points(batch: dict[str, Any]) -> int:
    """Observations in a batch (points): scalar points, vector rows and histograms; health keys excluded."""
    points = 0
    for series in batch.get("scalars", ()):
        if not series["key"].startswith(HEALTH_PREFIX):
            points += _step_count(series)
    for series in batch.get("vectors", ()):
        points += len(series["steps"])
    return points + len(batch.get("histograms", ()))


def last_step(batch: dict[str, Any]) -> int | None:
    """The largest step anything in the batch refers to, or None for a batch without steps."""
    steps = [max(series_steps(s)) for s in batch.get("scalars", ()) if _step_count(s)]
    steps += [max(s["steps"]) for s in batch.get("vectors", ()) if s["steps"]]
    steps += [h["step"] for h in batch.get("histograms", ())]
    steps += [e["step"] for e in batch.get("events", ())]
    return max(steps) if steps else None


def group_fragments(fragments: list[dict[str, Any]], max_points: int) -> list[list[dict[str, Any]]]:
    """Split consecutive fragments into groups that merge_fragments can combine into one batch each.

    A group holds at most `max_points` points (a larger fragment forms a group alone), fragments that
    agree on "layers", and no fragment with a field this module does not know.
    """
    groups: list[list[dict[str, Any]]] = []
    points = 0
    for fragment in fragments:
        size = batch_points(fragment)
        if groups and _joins(groups[-1], fragment) and points + size <= max_points:
            groups[-1].append(fragment)
            points += size
        else:
            groups.append([fragment])
            points = size
    return groups


def _joins(group: list[dict[str, Any]], fragment: dict[str, Any]) -> bool:
    if not (_MERGEABLE.issuperset(fragment) and _MERGEABLE.issuperset(group[0])):
        return False
    if group[-1].get("status") is not None:  # the status closes a run's data: nothing after it
        return False
    layers = next((f["layers"] for f in group if "layers" in f), None)
    return layers is None or fragment.get("layers", layers) == layers


def merge_fragments(fragments: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch's data from a group of group_fragments: series joined by key, steps in order.

    A (key, step) given twice keeps the later value, as storing the fragments one after the other
    would (and one INSERT must not touch a row twice on PostgreSQL).
    """
    if len(fragments) == 1:
        return dict(fragments[0])
    merged: dict[str, Any] = {
        "scalars": _merge_series(s for f in fragments for s in f.get("scalars", ())),
        "events": [e for f in fragments for e in f.get("events", ())],
    }
    vectors = _merge_series(s for f in fragments for s in f.get("vectors", ()))
    if vectors:
        merged["vectors"] = vectors
    histograms = {(h["key"], h["step"]): h for f in fragments for h in f.get("histograms", ())}
    if histograms:
        merged["histograms"] = list(histograms.values())
    for fragment in fragments:
        if "layers" in fragment:
            merged["layers"] = fragment["layers"]
        if fragment.get("status") is not None:
            merged["status"] = fragment["status"]
    return merged


def _merge_series(series: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in series:
        by_key.setdefault(s["key"], []).append(s)
    return [_join(key, parts) for key, parts in by_key.items()]


def _join(key: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One key's series of consecutive fragments as one. The usual case -- each part's steps in order
    and after the previous part's -- is a concatenation (a step repeated within one part travels as
    it came, as it does from a single fragment: the server keeps its later value); otherwise the steps
    are sorted and a step given twice keeps its later value."""
    if _in_order(parts):
        steps: list[int] = []
        values: list[Any] = []
        for part in parts:
            steps += part["steps"]
            values += part["values"]
        return {"key": key, "steps": steps, "values": values}
    points: dict[int, Any] = {}
    for part in parts:
        points.update(zip(part["steps"], part["values"], strict=True))
    ordered = sorted(points)
    return {"key": key, "steps": ordered, "values": [points[step] for step in ordered]}


def _in_order(parts: list[dict[str, Any]]) -> bool:
    """Whether each part's steps are in order and start after the previous part's last step (sorted()
    of a sorted list is one C pass: cheaper than comparing neighbours in Python)."""
    previous = None
    for part in parts:
        steps = part["steps"]
        if len(steps) != len(part["values"]):
            return False  # the general path reports it
        if not steps:
            continue
        if (previous is not None and steps[0] <= previous) or sorted(steps) != steps:
            return False
        previous = steps[-1]
    return True


# -- packed values (a server that announces "values_f64" / "steps_i64" in its answer to POST /runs) ----

VALUES_F64 = "values_f64"
STEPS_I64 = "steps_i64"
_PACK_FROM = 16  # a shorter series stays a JSON list: base64 of a few numbers saves nothing


def _b64(numbers: array[Any]) -> str:
    if sys.byteorder == "big":
        numbers.byteswap()
    return base64.b64encode(numbers.tobytes()).decode("ascii")


def _unb64(code: str, typecode: str) -> array[Any]:
    numbers = array(typecode, base64.b64decode(code))
    if sys.byteorder == "big":
        numbers.byteswap()
    return numbers


def pack_values(batch: dict[str, Any], steps: bool = False) -> dict[str, Any]:
    """The batch with each scalar series' values as base64 of little-endian float64 ("values_f64")
    and, with `steps`, its steps as base64 of little-endian int64 ("steps_i64"): encoding a number as
    JSON text costs the agent several times as much, and the server's parse and validation too.
    Non-finite values ("NaN", "Infinity", "-Infinity" on the wire) become the floats they name."""
    scalars = batch.get("scalars")
    if not scalars:
        return batch
    packed = []
    for series in scalars:
        values = series["values"]
        if len(values) < _PACK_FROM:
            packed.append(series)
            continue
        try:
            numbers = array("d", values)
        except TypeError:  # "NaN" / "Infinity" strings: float() reads them back
            numbers = array("d", map(float, values))
        series = {name: value for name, value in series.items() if name != "values"}
        series[VALUES_F64] = _b64(numbers)
        if steps:
            try:
                series[STEPS_I64] = _b64(array("q", series["steps"]))
                del series["steps"]
            except (TypeError, OverflowError):  # not int64s: the list goes as it is, the server says why
                pass
        packed.append(series)
    return {**batch, "scalars": packed}


def unpack_values(batch: dict[str, Any]) -> dict[str, Any]:
    """pack_values' inverse (values and steps as JSON-ready lists again): for code that cuts sealed
    batches."""
    scalars = batch.get("scalars")
    if not scalars or not any(VALUES_F64 in series or STEPS_I64 in series for series in scalars):
        return batch
    plain = []
    for series in scalars:
        if VALUES_F64 in series or STEPS_I64 in series:
            series = dict(series)
            if VALUES_F64 in series:
                series["values"] = [wire_float(value) for value in _unb64(series.pop(VALUES_F64), "d")]
            if STEPS_I64 in series:
                # a stdlib array decoded from the batch's bytes (sender thread): no tensor, no sync
                series["steps"] = _unb64(series.pop(STEPS_I64), "q").tolist()
        plain.append(series)
    return {**batch, "scalars": plain}


def series_steps(series: dict[str, Any]) -> list[int]:
    """A scalar or vector series' steps, from "steps" or from packed "steps_i64"."""
    code = series.get(STEPS_I64)
    # A stdlib array decoded from the batch's bytes, not a tensor: no device sync.
    return series["steps"] if code is None else _unb64(code, "q").tolist()


def _step_count(series: dict[str, Any]) -> int:
    code = series.get(STEPS_I64)
    if code is None:
        return len(series["steps"])
    return (len(code) // 4 * 3 - (len(code) - len(code.rstrip("=")))) // 8


# The most numbers one batch carries (a vector row holds one per layer, a histogram layers x bins): a
# server refuses larger batches (gradwatch.server.ingest_limits, the same 1,000,000 by default).
MAX_BATCH_VALUES = 1_000_000


LAYER_NAME_CHARS_PER_VALUE = 8  # a layer name's characters that cost a server about what one number does
# What an event counts for against a server's numbers cap. Validating one (its data is a free-form
# document) takes ~7.5 us on the server's event loop, twenty numbers' worth; weighed ten times that,
# one batch holds at most 10,000 events and its validation holds the loop ~0.1 s (90,000 events held
# it ~0.7 s, stalling every other tenant's requests: issue 28). An agent's batch has a few per step.
VALUES_PER_EVENT = 200


def layer_name_values(layers: Any) -> int:
    """What a batch's "layers" count for against a server's numbers cap: a value per
    LAYER_NAME_CHARS_PER_VALUE characters of each name, and one for the name (server.ingest_limits)."""
    if not isinstance(layers, list):
        return 0
    return sum(1 + len(name) // LAYER_NAME_CHARS_PER_VALUE if isinstance(name, str) else 1 for name in layers)


def split_by_steps(batch: dict[str, Any], max_points: int, max_values: int) -> list[dict[str, Any]]:
    """A sealed batch's data as consecutive step ranges of at most `max_points` points and `max_values`
    numbers each ([batch] when it fits): servers refuse larger batches. A step's keys stay together
    (alert rules read them side by side); a single step larger than the limits is a piece of its own.
    Events go with their steps (a point and VALUES_PER_EVENT numbers each), "layers" with every piece (its
    numbers count in each), the status (and any other field) with the last."""
    scalar_points = sum(len(series["steps"]) for series in batch.get("scalars", ()))
    vector_rows = [row for series in batch.get("vectors", ()) for row in series["values"]]
    histograms = batch.get("histograms", ())
    events = batch.get("events", ())
    max_values -= layer_name_values(batch.get("layers"))
    if (
        scalar_points + len(vector_rows) + len(histograms) + len(events) <= max_points
        and scalar_points
        + sum(map(len, vector_rows))
        + sum(len(r) for h in histograms for r in h["counts"])
        + VALUES_PER_EVENT * len(events)
        <= max_values
    ):
        return [batch]  # the usual case, counted without a dict per step
    sizes: dict[int, list[int]] = {}  # step -> [points, numbers]
    scalar_steps = Counter(chain.from_iterable(series["steps"] for series in batch.get("scalars", ())))
    for step, count in scalar_steps.items():
        sizes[step] = [count, count]
    for series in batch.get("vectors", ()):
        for step, row in zip(series["steps"], series["values"], strict=True):
            sizes.setdefault(step, [0, 0])
            sizes[step][0] += 1
            sizes[step][1] += len(row)
    for histogram in histograms:
        sizes.setdefault(histogram["step"], [0, 0])
        sizes[histogram["step"]][0] += 1
        sizes[histogram["step"]][1] += sum(map(len, histogram["counts"]))
    for event in events:
        size = sizes.setdefault(event["step"], [0, 0])
        size[0] += 1
        size[1] += VALUES_PER_EVENT
    starts: list[int] = []  # the first step of each piece
    points = values = 0
    for step in sorted(sizes):
        step_points, step_values = sizes[step]
        if starts and points + step_points <= max_points and values + step_values <= max_values:
            points, values = points + step_points, values + step_values
        else:
            starts.append(step)
            points, values = step_points, step_values
    return _pieces(batch, starts)


def halve_by_steps(batch: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A batch's data as two step ranges of about half its steps each (for a server that answered
    413); None when it holds fewer than two steps. Fields are distributed as by split_by_steps."""
    steps = sorted(batch_steps(batch))
    if len(steps) < 2:
        return None
    return _pieces(batch, [steps[0], steps[len(steps) // 2]])


def halve_batch(
    batch: dict[str, Any] | bytes, rank: int, next_seq: Callable[[], int]
) -> list[tuple[dict[str, Any], int]] | None:
    """A sealed batch (or its JSON) as two batches by halve_by_steps, each (batch, points) with a seq
    of its own from next_seq (and the batch's rank, else `rank`); None when it holds a single step."""
    data = unpack_values(json.loads(batch) if isinstance(batch, bytes) else batch)
    halves = halve_by_steps({k: v for k, v in data.items() if k not in ("rank", "seq")})
    if halves is None:
        return None
    rank = data.get("rank", rank)
    return [({"rank": rank, "seq": next_seq(), **half}, batch_points(half)) for half in halves]


def batch_steps(batch: dict[str, Any]) -> set[int]:
    steps: set[int] = set()
    for series in (*batch.get("scalars", ()), *batch.get("vectors", ())):
        steps.update(series_steps(series))
    steps.update(h["step"] for h in batch.get("histograms", ()))
    steps.update(e["step"] for e in batch.get("events", ()))
    return steps


def _pieces(batch: dict[str, Any], starts: list[int]) -> list[dict[str, Any]]:
    """The batch cut at `starts` (the first step of each piece; steps before the first go with it)."""
    scalars = _in_step_order(batch.get("scalars", ()))
    vectors = _in_step_order(batch.get("vectors", ()))
    pieces = []
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else None
        first = index == 0

        def within(step: int, start: int = start, end: int | None = end, first: bool = first) -> bool:
            return (first or step >= start) and (end is None or step < end)

        low = None if first else start
        piece: dict[str, Any] = {
            "scalars": _series_within(scalars, low, end),
            "events": [event for event in batch.get("events", ()) if within(event["step"])],
        }
        piece_vectors = _series_within(vectors, low, end)
        if piece_vectors:
            piece["vectors"] = piece_vectors
        histograms = [h for h in batch.get("histograms", ()) if within(h["step"])]
        if histograms:
            piece["histograms"] = histograms
        pieces.append(piece)
    for name, value in batch.items():
        if name == "layers":
            for piece in pieces:
                piece[name] = value
        elif name not in ("scalars", "events", "vectors", "histograms"):
            pieces[-1][name] = value
    return pieces


def _in_step_order(series_list: Any) -> list[dict[str, Any]]:
    """The series (scalar or vector) with their points in step order. They usually are already
    (Resolved.wire_fields and merge_fragments sort them): then the series are returned as they are."""
    out = []
    for series in series_list:
        steps = series["steps"]
        if not all(map(operator.lt, steps, islice(steps, 1, None))):  # out of order: sort a copy
            order = sorted(range(len(steps)), key=steps.__getitem__)
            values = series["values"]
            series = {**series, "steps": [steps[i] for i in order], "values": [values[i] for i in order]}
        out.append(series)
    return out


def _series_within(
    series_list: list[dict[str, Any]], start: int | None, end: int | None
) -> list[dict[str, Any]]:
    """Step-ordered series cut to start <= step < end (None: open) by bisection; series left empty
    are left out."""
    out = []
    for series in series_list:
        steps = series["steps"]
        lo = 0 if start is None else bisect_left(steps, start)
        hi = len(steps) if end is None else bisect_left(steps, end)
        if hi > lo:
            out.append({**series, "steps": steps[lo:hi], "values": series["values"][lo:hi]})
    return out


# -- batch identity: (run, rank, seq), unique across the processes of a run (see gradwatch._sender) --

SEQ_COUNTER_BITS = 20
_namespace_lock = threading.Lock()
_last_namespace = 0


def _new_namespace() -> int:
    """The current wall-clock millisecond, strictly above every namespace this process used."""
    global _last_namespace
    with _namespace_lock:
        _last_namespace = max(int(time.time() * 1000), _last_namespace + 1)
        return _last_namespace


MAX_KEY_LENGTH = 250  # the server's limit on a series key (server.schemas.MetricKey)


def key_problem(key: str) -> str | None:
    """Why the server would refuse `key` as a series key (empty, too long, a NUL character, a lone
    UTF-16 surrogate), or None when it is fine."""
    if not key:
        return "a key must not be empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"keys are at most {MAX_KEY_LENGTH} characters, this one has {len(key)}"
    if "\x00" in key:
        return "keys must not contain NUL characters"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "keys must be valid Unicode text (this one has a lone surrogate)"
    return None


class SeqAllocator:
    """Batch sequence numbers, unique per (run, rank) across processes: see the module docstring."""

    def __init__(self) -> None:
        self._namespace = _new_namespace()
        self._count = 0
        self.first = self._namespace << SEQ_COUNTER_BITS  # no seq of an earlier process reaches this

    def next(self) -> int:
        if self._count >= 1 << SEQ_COUNTER_BITS:
            self._namespace, self._count = _new_namespace(), 0
        self._count += 1
        return (self._namespace << SEQ_COUNTER_BITS) | (self._count - 1)
