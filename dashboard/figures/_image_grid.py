"""Where a layer × step heatmap's cells go in its image (figures.layers): the image's equally wide
columns of steps (`grid`), and the row of the layer × step matrix each cell shows (`cell_rows`).

A column shows the latest step at or before its right edge: a sampled value holds until the next
sample. A non-finite value (an alarm: a skipped step's overflow) does not: the agent records the
per-layer norms on every skipped step besides the sampled ones, so the steps after a skip that have
no record were not skipped, and a red cell held over them would draw one skip as many. Its cells
show the layer's latest earlier value instead, and the alarm is marked at its own step by the
heatmap's markers; only where a column is one step wide is the alarm's own cell red in the image.
"""

from __future__ import annotations

import math

import numpy as np

# At most this many image columns: no more than a wide screen's plot has pixels. The API sends at
# most 500 steps; irregular steps are laid on a regular grid (`grid`) of at most this width.
MAX_IMAGE_COLUMNS = 1200


def grid(steps: list[int]) -> tuple[float, float, list[int], bool]:
    """(x of the first column's centre, column width in steps, the row drawn in each column,
    whether every row's column is centred on its step).

    An image's columns are equally wide. Steps close to equally spaced (the API's downsampling
    gives the first step of equal buckets; an agent sampling every N steps records every Nth) are
    one column each, each step within its column; otherwise columns as wide as the closest two
    steps (at most MAX_IMAGE_COLUMNS of them), each showing the last step at or before its right
    edge."""
    if len(steps) == 1:
        return float(steps[0]), 1.0, [0], True
    at = np.asarray(steps, dtype=np.float64)
    dx = (at[-1] - at[0]) / (len(at) - 1)
    off_centre = np.abs(at - (at[0] + np.arange(len(at)) * dx))
    if off_centre.max() < dx / 2:
        return float(at[0]), float(dx), list(range(len(steps))), bool(off_centre.max() == 0)
    dx = max(float(np.diff(at).min()), (at[-1] - at[0]) / (MAX_IMAGE_COLUMNS - 1))
    count = math.floor((at[-1] - at[0]) / dx + 0.5) + 1  # the last column's right edge past the last step
    right_edges = at[0] + (np.arange(count) + 0.5) * dx
    rows = np.searchsorted(at, right_edges, side="right") - 1
    return float(at[0]), dx, [int(row) for row in rows], False


def cell_rows(
    steps: list[int], columns: list[int], x0: float, dx: float, alarms: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, red), both columns × layers: the matrix row each cell of the image shows (-1: none,
    a blank cell) and where the cell is an alarm drawn red.

    steps, and `grid`'s x0, dx and columns (the row each column shows); alarms: steps × layers,
    True where a value is an alarm (layers.alarm_cells). An alarm's cells show the layer's latest
    earlier row that is no alarm, except, in columns one step wide, the alarm's own step's cell."""
    shown = np.asarray(columns, dtype=np.intp)
    no_alarm = np.where(alarms, -1, np.arange(len(steps))[:, None])
    rows = np.maximum.accumulate(no_alarm, axis=0)[shown]  # the latest row at or before, no alarm
    red = np.zeros(rows.shape, bool)
    if dx <= 1:
        own = np.abs(np.asarray(steps, dtype=np.float64)[shown] - (x0 + np.arange(len(shown)) * dx)) < 0.5
        red = alarms[shown] & own[:, None]
        rows = np.where(red, shown[:, None], rows)
    return rows, red


def take_cells(matrix: np.ndarray, rows: np.ndarray, fill: float | bool) -> np.ndarray:
    """matrix (steps × layers) read at `rows` (columns × layers, cell_rows'): columns × layers,
    `fill` where a row is -1."""
    taken = matrix[np.maximum(rows, 0), np.arange(matrix.shape[1])]
    return np.where(rows >= 0, taken, fill)
