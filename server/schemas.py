"""Request and response bodies of the JSON API (pydantic), apart from the ORM tables.

Non-finite floats: requests may carry JSON's NaN/Infinity literals or the strings "NaN", "Infinity",
"-Infinity"; responses always use the strings, so any JSON parser reads them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Client- or server-chosen id")]
Name = Annotated[str, Field(min_length=1, max_length=200)]
MetricKey = Annotated[str, Field(min_length=1, max_length=250)]
Step = Annotated[int, Field(ge=0, le=2**62)]
RunStatus = Literal["running", "finished", "crashed"]

# Per batch: an agent flushes about once a second, so these are generous.
MAX_SERIES_PER_BATCH = 10_000
MAX_POINTS_PER_SERIES = 1_000_000
MAX_EVENTS_PER_BATCH = 100_000


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: RunId | None = None
    project: Name
    name: Name | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class RunSummary(BaseModel):
    skips: int = Field(description="skip events stored for the run")
    scale: float | str | None = Field(description="latest amp/scale of rank 0, if any")


class RunOut(BaseModel):
    id: str
    project: str
    name: str
    status: str
    created_at: str
    updated_at: str
    last_step: int | None
    config: dict[str, Any]
    metadata: dict[str, Any]
    summary: RunSummary


class RunList(BaseModel):
    data: list[RunOut]
    count: int = Field(description="runs matching the filter, before limit/offset")


class ScalarSeriesIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    steps: list[Step] = Field(max_length=MAX_POINTS_PER_SERIES)
    values: list[float] = Field(max_length=MAX_POINTS_PER_SERIES)

    @model_validator(mode="after")
    def _same_length(self) -> ScalarSeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"series {self.key!r}: {len(self.steps)} steps but {len(self.values)} values; "
                "they must pair up"
            )
        return self


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: Step
    kind: Annotated[str, Field(min_length=1, max_length=64)]
    data: dict[str, Any] = Field(default_factory=dict)


class BatchIn(BaseModel):
    """One flush of one agent rank. (run, rank, seq) identifies it: a repeat is acknowledged, not stored."""

    model_config = ConfigDict(extra="forbid")

    rank: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    seq: Annotated[int, Field(ge=0)]
    scalars: list[ScalarSeriesIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    events: list[EventIn] = Field(default_factory=list, max_length=MAX_EVENTS_PER_BATCH)
    status: RunStatus | None = None


class BatchAck(BaseModel):
    duplicate: bool = Field(description="true when this (run, rank, seq) was stored before")
    points: int
    events: int


JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"]


class SeriesOut(BaseModel):
    key: str
    rank: int
    steps: list[int]
    values: list[JsonFloat]
    downsampled: bool = Field(description="true when the range held more than max_points points")


class EventOut(BaseModel):
    step: int
    kind: str
    rank: int
    data: dict[str, Any]


class EventList(BaseModel):
    data: list[EventOut]
    count: int


class KeyList(BaseModel):
    data: list[str]


def json_float(value: float) -> JsonFloat:
    """A float as the API writes it: finite as a number, the rest as "NaN"/"Infinity"/"-Infinity"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"
