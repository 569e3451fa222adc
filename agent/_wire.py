"""The wire format between agent and server: JSON documents, non-finite floats as strings.

A batch is one JSON object: its identity ("rank", "seq": the server stores a (run, rank, seq) once) and
its data fields ("scalars", "events", and what Resolved.wire_fields adds: "vectors", "histograms",
"layers"), plus an optional run "status". When the server is slower than the flushes, the sender
merges the data of several flushes into one batch before giving it a seq (merge_fragments).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
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
            points += len(series["steps"])
    for series in batch.get("vectors", ()):
        points += len(series["steps"])
    return points + len(batch.get("histograms", ()))


def last_step(batch: dict[str, Any]) -> int | None:
    """The largest step anything in the batch refers to, or None for a batch without steps."""
    steps = [max(s["steps"]) for s in batch.get("scalars", ()) if s["steps"]]
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
    by_key: dict[str, dict[int, Any]] = {}
    for s in series:
        by_key.setdefault(s["key"], {}).update(zip(s["steps"], s["values"], strict=True))
    return [
        {"key": key, "steps": sorted(points), "values": [points[step] for step in sorted(points)]}
        for key, points in by_key.items()
    ]
