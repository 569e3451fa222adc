"""Tables from a run's series (gradwatch.api): row dicts, pandas DataFrames, CSV; the optional
libraries (pandas for frames, pyarrow for parquet) imported only when asked for."""

from __future__ import annotations

import csv
import importlib
from collections.abc import Iterable
from typing import IO, Any

Row = dict[str, Any]

__all__ = ["Row", "Series", "pandas_module", "pyarrow_modules", "to_frame", "to_rows", "write_csv"]


# -- optional libraries ---------------------------------------------------------------------------


def pandas_module(as_frame: bool | None) -> Any:
    """pandas when a DataFrame is wanted (as_frame True, or None and pandas importable), else None."""
    if as_frame is False:
        return None
    try:
        return importlib.import_module("pandas")
    except ImportError:
        if as_frame:
            raise ImportError("as_frame=True needs pandas: pip install pandas") from None
        return None


def pyarrow_modules() -> tuple[Any, Any]:
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ImportError(
            "parquet export needs pyarrow, which is not installed: pip install pyarrow (or export csv)"
        ) from None


# -- shaping --------------------------------------------------------------------------------------

Series = list[tuple[str, dict[int, tuple[list[int], list[float]]]]]


def to_rows(series: Series, keys: list[str], many_ranks: bool) -> list[Row]:
    table: dict[tuple[int, int], Row] = {}
    for key, per_rank in series:
        for rank, (steps, values) in per_rank.items():
            for step, value in zip(steps, values, strict=True):
                row = table.get((step, rank))
                if row is None:
                    row = {"step": step, "rank": rank} if many_ranks else {"step": step}
                    row.update(dict.fromkeys(keys))
                    table[(step, rank)] = row
                row[key] = value
    return [table[at] for at in sorted(table)]


def to_frame(pd: Any, series: Series, keys: list[str], many_ranks: bool) -> Any:
    columns: dict[str, Any] = {}
    for key, per_rank in series:
        steps: list[int] = []
        ranks: list[int] = []
        values: list[float] = []
        for rank, (rank_steps, rank_values) in per_rank.items():
            steps.extend(rank_steps)
            ranks.extend([rank] * len(rank_steps))
            values.extend(rank_values)
        if many_ranks:
            index = pd.MultiIndex.from_arrays(
                [pd.Index(steps, dtype="int64"), pd.Index(ranks, dtype="int64")], names=["step", "rank"]
            )
        else:
            index = pd.Index(steps, dtype="int64", name="step")
        columns[key] = pd.Series(values, index=index, dtype="float64")
    if not columns or all(len(c) == 0 for c in columns.values()):
        if many_ranks:
            empty = pd.MultiIndex.from_arrays([[], []], names=["step", "rank"])
        else:
            empty = pd.Index([], dtype="int64", name="step")
        return pd.DataFrame({key: pd.Series([], index=empty, dtype="float64") for key in keys}, index=empty)
    frame = pd.DataFrame(columns).sort_index()
    frame = frame[keys]
    return frame


def write_csv(file: IO[str], columns: list[str], rows: Iterable[Row]) -> None:
    writer = csv.writer(file, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if (value := row.get(name)) is None else _csv_value(value) for name in columns])


def _csv_value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float: nan, inf, -inf too
    return str(value)
