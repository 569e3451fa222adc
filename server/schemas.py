"""Request and response bodies of the JSON API (pydantic), apart from the ORM tables.

Non-finite floats: requests may carry JSON's NaN/Infinity literals or the strings "NaN", "Infinity",
"-Infinity"; responses always use the strings, so any JSON parser reads them. The field types and
limits are in schema_fields, the alerting API's bodies in alert_schemas; both are re-exported here.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from .alert_schemas import (
    AlertList,
    AlertOut,
    AlertRuleIn,
    AlertRuleList,
    AlertRuleOut,
    AlertRulePatch,
    DeliveryList,
    DeliveryOut,
    IncidentFinding,
    IncidentList,
    IncidentOut,
    RuleParamOut,
    RuleTypeList,
    RuleTypeOut,
    RunHealth,
    WebhookFormat,
    WebhookIn,
    WebhookList,
    WebhookOut,
)
from .schema_fields import (
    CREATED_AT_MAX_AGE_DAYS,
    CREATED_AT_SKEW_S,
    MAX_DOCUMENT_DEPTH,
    MAX_EVENTS_PER_BATCH,
    MAX_POINTS_PER_SERIES,
    MAX_SERIES_PER_BATCH,
    MAX_STEP,
    MAX_TAGS,
    CreatedAt,
    Document,
    JsonFloat,
    MetricKey,
    Name,
    ResumeMode,
    RunId,
    RunStatus,
    Step,
    Tag,
    Text,
)

__all__ = [
    "CREATED_AT_MAX_AGE_DAYS",
    "CREATED_AT_SKEW_S",
    "MAX_DOCUMENT_DEPTH",
    "MAX_EVENTS_PER_BATCH",
    "MAX_LAYERS",
    "MAX_POINTS_PER_SERIES",
    "MAX_SERIES_PER_BATCH",
    "MAX_STEP",
    "MAX_TAGS",
    "WIRE_FEATURES",
    "AlertList",
    "AlertOut",
    "AlertRuleIn",
    "AlertRuleList",
    "AlertRuleOut",
    "AlertRulePatch",
    "BatchAck",
    "BatchIn",
    "CombinedHistogramsOut",
    "CombinedSeriesOut",
    "CombinedVectorsOut",
    "CompareOut",
    "CompareSeries",
    "CreatedAt",
    "DeliveryList",
    "DeliveryOut",
    "DisagreementList",
    "DisagreementOut",
    "Document",
    "EventIn",
    "EventList",
    "EventOut",
    "HistogramIn",
    "HistogramsOut",
    "IncidentFinding",
    "IncidentList",
    "IncidentOut",
    "JsonFloat",
    "KeyList",
    "LayerName",
    "MetricKey",
    "Name",
    "RankList",
    "RankOut",
    "ResumeMode",
    "RuleParamOut",
    "RuleTypeList",
    "RuleTypeOut",
    "RunCreated",
    "RunHealth",
    "RunId",
    "RunIn",
    "RunList",
    "RunOut",
    "RunPatch",
    "RunStatus",
    "RunSummary",
    "ScalarSeriesIn",
    "SeriesOut",
    "Step",
    "Tag",
    "Text",
    "VectorSeriesIn",
    "VectorsOut",
    "WebhookFormat",
    "WebhookIn",
    "WebhookList",
    "WebhookOut",
    "json_float",
]


def _unpacked(code: Any, name: str, dtype: str) -> np.ndarray:
    """The numbers of a packed series field (base64 of 8-byte little-endian numbers)."""
    if not isinstance(code, str) or len(code) > (MAX_POINTS_PER_SERIES * 8 + 2) // 3 * 4:
        raise ValueError(f"{name} must be a base64 string of at most MAX_POINTS_PER_SERIES numbers")
    try:
        raw = base64.b64decode(code, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{name} is not valid base64: {exc}") from None
    if len(raw) % 8:
        unit = "float64s" if dtype.endswith("f8") else "int64s"
        raise ValueError(f"{name} holds {len(raw)} bytes, not a whole number of {unit}")
    return np.frombuffer(raw, dtype=dtype)


def _no_booleans(values: Any) -> Any:
    """JSON true/false would pass as 1.0/0.0; a metric that is a boolean is a client bug."""
    if isinstance(values, list) and bool in set(map(type, values)):  # at C speed: batches are large
        raise ValueError('values must be numbers (or "NaN", "Infinity", "-Infinity"), not true/false')
    return values


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: RunId | None = None
    project: Name
    name: Name | None = None
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS)
    config: Document = Field(default_factory=dict)
    metadata: Document = Field(default_factory=dict)
    resume: ResumeMode | None = Field(
        default=None,
        description=(
            'continue an existing run (gradwatch.init(resume=...)): "allow" creates the run when there is '
            'none, "must" answers 404 then, "never" answers 409 when the id exists; "allow" and "must" set '
            "an existing run running again. Left out: create, or return the existing run unchanged"
        ),
    )
    created_at: CreatedAt | None = Field(
        default=None,
        description=(
            "when the run really started, ISO 8601 (a time without a zone is UTC), for a run uploaded "
            "after it ran (`gradwatch sync` of an offline run): the created run shows this time. At most "
            f"{CREATED_AT_SKEW_S} s after the server's clock (clock skew: stored as the server's now) and "
            f"at most {CREATED_AT_MAX_AGE_DAYS} days before it, else 422. Left out: the server's time now. "
            "Ignored when the run exists already"
        ),
    )


class RunPatch(BaseModel):
    """Rename a run or replace its tags; fields left out are unchanged."""

    model_config = ConfigDict(extra="forbid")

    name: Name | None = None
    tags: list[Tag] | None = Field(default=None, max_length=MAX_TAGS)


class RunSummary(BaseModel):
    skips: int = Field(description="skip events stored for the run")
    scale: float | str | None = Field(description="latest amp/scale of rank 0, if any")


class RunOut(BaseModel):
    id: str
    project: str
    name: str
    status: str
    status_reason: str | None = Field(
        default=None,
        description='why a run is "crashed": "ValueError: …" (the exception that ended it), "SIGTERM", '
        'or "no heartbeat" (no rank reported for the server\'s crashed_after_s; undone by new data)',
    )
    created_at: str
    updated_at: str
    last_step: int | None
    tags: list[str]
    config: dict[str, Any]
    metadata: dict[str, Any]
    summary: RunSummary


# Batch encodings a server reads beyond plain JSON lists, announced in RunCreated.wire_features: an
# agent uses one only when the server it talks to named it.
WIRE_FEATURES = ("values_f64", "steps_i64")


class RunCreated(RunOut):
    resumed: bool | None = Field(
        default=None,
        description="with `resume` in the request: whether an existing run was continued (false: created)",
    )
    previous_status: str | None = Field(
        default=None, description="a continued run's status before this request set it running"
    )
    previous_status_reason: str | None = Field(default=None, description="and its status_reason then")
    wire_features: list[str] = Field(
        default_factory=lambda: list(WIRE_FEATURES),
        description="batch encodings this server reads beyond plain JSON lists (values_f64, steps_i64: "
        "ScalarSeriesIn)",
    )


class RunList(BaseModel):
    data: list[RunOut]
    count: int = Field(description="runs matching the filter, before limit/offset")


class CompareSeries(BaseModel):
    run_id: str
    name: str
    project: str
    steps: list[int]
    values: list[JsonFloat]
    downsampled: bool


class CompareOut(BaseModel):
    key: str
    rank: int
    data: list[CompareSeries] = Field(description="one series per requested run, in the order asked")


class ScalarSeriesIn(BaseModel):
    """One key's points: `steps` and, paired with them, `values` (JSON numbers, or "NaN", "Infinity",
    "-Infinity") or `values_f64` (the same values as base64 of little-endian float64: what the agent
    sends to a server that announces it; a float costs it 11 characters and no decimal conversion);
    likewise `steps_i64` for the steps (base64 of little-endian int64)."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    steps: list[Step] = Field(max_length=MAX_POINTS_PER_SERIES)
    values: list[float] = Field(max_length=MAX_POINTS_PER_SERIES)

    # (steps, values, the same as int64 / float64 arrays or None) when they came packed: storage takes
    # the arrays as they are. Kept with the lists they mirror, so a copy with other lists (model_copy)
    # does not use them.
    _packed: tuple[list[int], list[float], np.ndarray | None, np.ndarray | None] | None = PrivateAttr(
        default=None
    )

    @model_validator(mode="wrap")
    @classmethod
    def _packed_values(cls, data: Any, handler: ModelWrapValidatorHandler[ScalarSeriesIn]) -> ScalarSeriesIn:
        if not isinstance(data, dict) or ("values_f64" not in data and "steps_i64" not in data):
            return handler(data)
        data = dict(data)
        values = steps = None
        if "values_f64" in data:
            if "values" in data:
                raise ValueError("give a series' values as `values` or as `values_f64`, not both")
            values = _unpacked(data.pop("values_f64"), "values_f64", "<f8").astype(np.float64)
            data["values"] = values
        if "steps_i64" in data:
            if "steps" in data:
                raise ValueError("give a series' steps as `steps` or as `steps_i64`, not both")
            steps = _unpacked(data.pop("steps_i64"), "steps_i64", "<i8").astype(np.int64)
            if len(steps) and (int(steps.min()) < 0 or int(steps.max()) > MAX_STEP):
                raise ValueError(f"steps_i64: every step must be between 0 and {MAX_STEP}")
            data["steps"] = steps
        series = handler(data)
        series._packed = (series.steps, series.values, steps, values)
        return series

    @field_validator("steps", mode="wrap")
    @classmethod
    def _steps(cls, steps: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(steps, np.ndarray):  # unpacked from steps_i64 above: int64s, range checked
            return steps.tolist()
        return handler(steps)

    @field_validator("values", mode="wrap")
    @classmethod
    def _numbers(cls, values: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(values, np.ndarray):  # unpacked from values_f64 above: float64s
            return values.tolist()
        return handler(_no_booleans(values))

    def steps_array(self) -> np.ndarray:
        """The steps as int64 (without a copy when they came as steps_i64)."""
        packed = self._packed
        if packed is not None and packed[2] is not None and packed[0] is self.steps:
            return packed[2]
        return np.asarray(self.steps, dtype=np.int64)

    def values_array(self) -> np.ndarray:
        """The values as float64 (without a copy when they came as values_f64)."""
        packed = self._packed
        if packed is not None and packed[3] is not None and packed[1] is self.values:
            return packed[3]
        return np.asarray(self.values, dtype=np.float64)

    @model_validator(mode="after")
    def _same_length(self) -> ScalarSeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"series {self.key!r}: {len(self.steps)} steps but {len(self.values)} values; "
                "they must pair up"
            )
        return self


MAX_LAYERS = 100_000
LayerName = Annotated[str, Field(min_length=1, max_length=500), Text]


class VectorSeriesIn(BaseModel):
    """One per-layer quantity (e.g. "grad/norm") at several steps: a row of one value per layer."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    steps: list[Step] = Field(max_length=100_000)
    values: list[list[float]] = Field(max_length=100_000)

    @field_validator("values", mode="before")
    @classmethod
    def _numbers(cls, rows: Any) -> Any:
        if isinstance(rows, list):
            for row in rows:
                _no_booleans(row)
        return rows

    @model_validator(mode="after")
    def _rows_pair_with_steps(self) -> VectorSeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"vector {self.key!r}: {len(self.steps)} steps but {len(self.values)} rows; they must pair up"
            )
        widths = {len(row) for row in self.values}
        if len(widths) > 1:
            raise ValueError(f"vector {self.key!r}: rows have different lengths {sorted(widths)}")
        if widths and widths.pop() > MAX_LAYERS:
            raise ValueError(f"vector {self.key!r}: more than {MAX_LAYERS} layers")
        return self


class HistogramIn(BaseModel):
    """Per-layer log2 histograms at one step. Each row: counts for exponents exponent_min..exponent_max
    (bin e counts |g| in [2^(e-1), 2^e)), then the count of zeros, then of NaN/±Inf."""

    model_config = ConfigDict(extra="forbid")

    key: MetricKey
    step: Step
    exponent_min: Annotated[int, Field(ge=-2000, le=2000)]
    exponent_max: Annotated[int, Field(ge=-2000, le=2000)]
    counts: list[list[Annotated[int, Field(ge=0, le=2**63 - 1)]]] = Field(max_length=MAX_LAYERS)

    @model_validator(mode="after")
    def _row_width(self) -> HistogramIn:
        if self.exponent_max < self.exponent_min:
            raise ValueError(
                f"histogram {self.key!r}: exponent_max {self.exponent_max} < exponent_min {self.exponent_min}"
            )
        width = self.exponent_max - self.exponent_min + 3
        for index, row in enumerate(self.counts):
            if len(row) != width:
                raise ValueError(
                    f"histogram {self.key!r}: row {index} has {len(row)} counts, expected {width} "
                    "(one per exponent, then zeros, then non-finite)"
                )
        return self


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: Step
    kind: Annotated[str, Field(min_length=1, max_length=64), Text]
    data: Document = Field(default_factory=dict)


class BatchIn(BaseModel):
    """One flush of one agent rank. (run, rank, seq) identifies it: a repeat is acknowledged, not stored."""

    model_config = ConfigDict(extra="forbid")

    rank: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    seq: Annotated[int, Field(ge=0, le=2**63 - 1)]
    scalars: list[ScalarSeriesIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    events: list[EventIn] = Field(default_factory=list, max_length=MAX_EVENTS_PER_BATCH)
    vectors: list[VectorSeriesIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    histograms: list[HistogramIn] = Field(default_factory=list, max_length=MAX_SERIES_PER_BATCH)
    layers: list[LayerName] | None = Field(
        default=None, max_length=MAX_LAYERS, description="names of the vectors' entries, in order"
    )
    status: RunStatus | None = None


class VectorsOut(BaseModel):
    key: str
    rank: int
    layers: list[str]
    steps: list[int] = Field(description="first step of each (possibly downsampled) column")
    values: list[list[JsonFloat]] = Field(description="one row per step, one value per layer")
    downsampled: bool = Field(description="true when steps were merged (max per layer, non-finite kept)")


class HistogramsOut(BaseModel):
    key: str
    rank: int
    layer: str
    exponents: list[int] = Field(description="bin e counts |g| in [2^(e-1), 2^e); ends are open")
    steps: list[int]
    counts: list[list[int]] = Field(description="one row per step, one count per exponent")
    zeros: list[int]
    non_finite: list[int]


class BatchAck(BaseModel):
    duplicate: bool = Field(description="true when this (run, rank, seq) was stored before")
    points: int
    events: int
    superseded_from: int | None = Field(
        None,
        description="present when a later process resumed the rank at this step: the batch's data from "
        "this step on is kept with the attempt the resume replaced (GET .../attempts), not in the run",
    )
    second_writer: bool | None = Field(
        None,
        description="present (true) when this process still writes the rank long after another resumed it: "
        "two jobs share the run id",
    )
    incidents: list[dict[str, Any]] | None = Field(
        None,
        description="with ?guard=true: the run's open incidents after this batch (id, severity, cause_key, "
        "title, cause, next_steps, first_step, last_healthy_step, suspect_steps, suspect_batches, ...)",
    )


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
    kind: str


def json_float(value: float) -> JsonFloat:
    """A float as the API writes it: finite as a number, the rest as "NaN"/"Infinity"/"-Infinity"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


# -- the ranks of a distributed run ---------------------------------------------------------------


class RankOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.RankInfo

    rank: int
    host: str | None
    local_rank: int | None
    world_size: int | None
    pid: int | None
    parallelism: str | None = Field(description="fsdp2, fsdp, ddp, dtensor or none")
    gradients: str | None = Field(description="sharded, replicated, hybrid or local")
    histograms: bool | None = Field(description="whether this rank takes gradient histograms")
    status: str | None = Field(description="how the rank ended (finished, crashed); null while running")
    batches: int
    last_seen: float | None = Field(description="seconds since the epoch of the rank's newest batch")


class RankList(BaseModel):
    data: list[RankOut]
    count: int
    world_size: int
    gradients: str = Field(description="the layout the ranks reported; mixed if they differ")


class CombinedSeriesOut(BaseModel):
    key: str
    combine: str = Field(description="the mode applied (auto resolved)")
    ranks: list[int]
    steps: list[int]
    values: list[JsonFloat]
    per_rank: dict[str, list[JsonFloat]] = Field(description="rank -> its value at each of steps")
    downsampled: bool


class CombinedVectorsOut(BaseModel):
    key: str
    combine: str
    ranks: list[int]
    layers: list[str]
    steps: list[int]
    values: list[list[JsonFloat]]
    downsampled: bool


class CombinedHistogramsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.CombinedHistograms

    key: str
    layer: str
    combine: str
    ranks: list[int]
    exponents: list[int]
    steps: list[int]
    counts: list[list[int]]
    zeros: list[int]
    non_finite: list[int]


class DisagreementOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from storage.ranks.Disagreement

    step: int
    skipped_ranks: list[int]
    applied_ranks: list[int]
    layers: list[str]


class DisagreementList(BaseModel):
    data: list[DisagreementOut]
    count: int = Field(description="disagreeing steps in the range, before limit")
