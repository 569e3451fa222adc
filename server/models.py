"""ORM tables (SQLAlchemy 2, typed). The schema itself is created only by the Alembic migrations in
gradwatch.migrations; tests check that the two agree.

Non-finite floats are stored as value NULL plus an explicit flag (SQLite cannot store NaN), see Flag.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Flag(enum.IntEnum):
    """How a stored float is to be read: FINITE uses the value column, the others mean value IS NULL."""

    FINITE = 0
    NAN = 1
    POS_INF = 2
    NEG_INF = 3


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)

    if TYPE_CHECKING:
        # Every model here is mapped to a Table (__tablename__, no custom selectable): SQLAlchemy types
        # __table__ as any FromClause, which has no .name or .insert() (storage.bulk reads both).
        __table__: ClassVar[Table]


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    # JSON documents as text: portable between SQLite and PostgreSQL and opaque to queries.
    config_json: Mapped[str] = mapped_column(Text, default="{}")
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    created_at: Mapped[float] = mapped_column(Float)  # seconds since the epoch, UTC
    updated_at: Mapped[float] = mapped_column(Float)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Names of the entries of the run's per-layer vectors, in the model's order (JSON list).
    layers_json: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    # The id the agent asked for when it was another project's already (migration 0009); the run is
    # then stored under a fresh id, found again by (project, requested_id).
    requested_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Why the run is "crashed" (migration 0010): the agent's exception ("ValueError: loss is NaN"), a
    # signal ("SIGTERM"), or NO_HEARTBEAT when the server marked a silent run (undone by new data).
    status_reason: Mapped[str | None] = mapped_column(String(500), nullable=True)
    # The last step stored when the run last finished (migration 0012): its history, which a resume
    # may replace only with an admin token (storage.resumes).
    finished_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        Index("uq_runs_project_requested_id", "project", "requested_id", unique=True),
        # The liveness sweep: running runs silent since before a moment (storage.liveness).
        Index(None, "status", "updated_at"),
    )


class Series(Base):
    """One key of one run (e.g. "amp/scale", "grad/norm"); points refer to it by a small integer id.

    kind: "scalar" (points), "vector" (vector_points) or "histogram" (histogram_points)."""

    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("run_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(250))
    kind: Mapped[str] = mapped_column(String(16), default="scalar", server_default="scalar")


# _NO_FOREIGN_KEY: the per-point tables (point_chunks, vector_points, histogram_points and the rollups) refer
# to series.id without a FOREIGN KEY constraint (migration 0007). A constraint is checked for every
# inserted row (PostgreSQL locks the series row per point): it cost as much as the insert itself.
# The store keeps the reference intact instead: ingest takes a KEY SHARE lock on the run row, and
# delete_run locks that row FOR UPDATE before deleting the run's rows table by table.


class PointChunk(Base):
    """Up to a few thousand consecutive points of one (series, rank), as compressed step and value
    arrays (storage.chunked_points, migration 0011): one row per chunk instead of one per point.
    Chunks of a (series, rank) cover disjoint [first_step, last_step] intervals."""

    __tablename__ = "point_chunks"
    # (series, rank, last_step): the chunks ending at or after a step (a range read, a batch's overlap
    # check, the newest step) without walking the series' earlier chunks.
    __table_args__ = (Index(None, "series_id", "rank", "last_step"),)

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # series.id: see _NO_FOREIGN_KEY
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer)
    step_data: Mapped[bytes] = mapped_column(LargeBinary)
    value_data: Mapped[bytes] = mapped_column(LargeBinary)


class VectorPoint(Base):
    """One value per layer at one step, as little-endian float64 bytes (NaN/±Inf kept as they are)."""

    __tablename__ = "vector_points"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # series.id: see _NO_FOREIGN_KEY
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class HistogramPoint(Base):
    """Per-layer log2 histograms at one step: little-endian int64 counts, layers x (bins + 2)."""

    __tablename__ = "histogram_points"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # series.id: see _NO_FOREIGN_KEY
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    exponent_min: Mapped[int] = mapped_column(Integer)
    exponent_max: Mapped[int] = mapped_column(Integer)
    counts: Mapped[bytes] = mapped_column(LargeBinary)


class Event(Base):
    """Something that happened at a step: a skipped optimizer step ("skip"), a misuse warning…"""

    __tablename__ = "events"
    # (run, step) for the run page and alerts; (run, rank, step) for live streams' per-rank cursors.
    __table_args__ = (Index(None, "run_id", "step"), Index(None, "run_id", "rank", "step"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(64))
    data_json: Mapped[str] = mapped_column(Text, default="{}")


class AgentBatch(Base):
    """Every accepted batch's (run, rank, seq): a retried or replayed batch is recognised and ignored."""

    __tablename__ = "agent_batches"

    run_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[float] = mapped_column(Float)


class RunResume(Base):
    """A process that resumed the run (migration 0010): from `step` on, the rank's data of every earlier
    process is superseded. Earlier processes are those whose batches have a seq below seq_floor (a
    sender's seqs start at its start time in milliseconds << 20: see the agent's _sender), so a batch of
    an abandoned attempt that arrives late (a spool replayed, `gradwatch sync`) is still cut at `step`."""

    __tablename__ = "run_resumes"

    run_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq_floor: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)


class RunAttempt(Base):
    """What a resume took out of a rank's default view (migration 0017): the data an abandoned attempt
    (an earlier process of the run) had stored from `from_step` on, kept rather than deleted, readable by
    anyone who may read the run and restorable by an admin (gradwatch.server.storage.attempts). Late
    batches of the superseded processes are kept here too; one still sending long after the resume is a
    second writer (second_writer_at)."""

    __tablename__ = "run_attempts"
    __table_args__ = (Index(None, "run_id", "rank", "from_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    from_step: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(String(32))  # "resume", or "restore" (what a restore replaced)
    seq_floor: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # the process that took over
    created_at: Mapped[float] = mapped_column(Float)
    points: Mapped[int] = mapped_column(BigInteger, default=0)  # scalar points, vector rows, histograms
    events: Mapped[int] = mapped_column(BigInteger, default=0)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    late_batches: Mapped[int] = mapped_column(Integer, default=0)
    first_late_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_late_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    second_writer_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    restored_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class RunAttemptPart(Base):
    """One piece of a kept attempt: a gzip-compressed batch document in the ingest wire format (steps at
    or after the attempt's from_step), so that a restore writes it the way ingest does."""

    __tablename__ = "run_attempt_parts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    attempt_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("run_attempts.id", ondelete="CASCADE"), index=True
    )
    data: Mapped[bytes] = mapped_column(LargeBinary)


# -- rollups and tags (migration 0004) --------------------------------------------------------------


class PointRollup(Base):
    """One bucket of a scalar series' pyramid (gradwatch.server.storage.rollups): steps
    [bucket * 32**level, (bucket + 1) * 32**level) summarised by their lowest and highest point (a
    non-finite point counts as the lowest; high_* repeats low_* when the bucket has no finite point)."""

    __tablename__ = "point_rollups"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # series.id: see _NO_FOREIGN_KEY
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    low_step: Mapped[int] = mapped_column(BigInteger)
    low_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    low_flag: Mapped[int] = mapped_column(SmallInteger)
    high_step: Mapped[int] = mapped_column(BigInteger)
    high_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    high_flag: Mapped[int] = mapped_column(SmallInteger)


class VectorRollup(Base):
    """One bucket of a per-layer vector's pyramid: per layer the first non-finite value, else the
    largest (what a heatmap cell shows), as little-endian float64 bytes; first_step is the bucket's
    earliest stored step."""

    __tablename__ = "vector_rollups"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # series.id: see _NO_FOREIGN_KEY
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RunTag(Base):
    """A free-form label of a run ("baseline", "lora-r16"); runs are filtered by them."""

    __tablename__ = "run_tags"
    __table_args__ = (Index(None, "tag"),)

    run_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    tag: Mapped[str] = mapped_column(String(100), primary_key=True)


# -- alerts (migration 0003) ------------------------------------------------------------------------


class AlertProject(Base):
    """A project whose default alert rules were installed (once: deleting them does not bring them back)."""

    __tablename__ = "alert_projects"

    project: Mapped[str] = mapped_column(String(200), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)


class AlertRule(Base):
    """One rule: a type from gradwatch.server.alerts.rules with its parameters, scoped to a project or
    to one run of it (run_id set)."""

    __tablename__ = "alert_rules"
    __table_args__ = (Index(None, "project", "run_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(200))
    run_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), nullable=True
    )
    type: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    params_json: Mapped[str] = mapped_column(Text, default="{}")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    cooldown_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class AlertRuleState(Base):
    """An incremental evaluator's state for one (rule, run), written in the ingest transaction."""

    __tablename__ = "alert_rule_states"

    rule_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True
    )
    run_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    state_json: Mapped[str] = mapped_column(Text, default="{}")
    updated_at: Mapped[float] = mapped_column(Float)


class Alert(Base):
    """A rule that fired for a run. open_key is "rule/run" while firing and NULL once resolved: the
    unique constraint makes "at most one open alert per rule and run" hold across server processes."""

    __tablename__ = "alerts"
    __table_args__ = (Index(None, "project", "created_at"), Index(None, "run_id", "step"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rule_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("alert_rules.id", ondelete="SET NULL"), nullable=True
    )
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    project: Mapped[str] = mapped_column(String(200))
    type: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # firing | resolved
    open_key: Mapped[str | None] = mapped_column(String(100), nullable=True, unique=True)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # where the condition first held
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    occurrences: Mapped[int] = mapped_column(Integer, default=1)
    title: Mapped[str] = mapped_column(String(500))
    hint: Mapped[str] = mapped_column(Text)
    evidence_json: Mapped[str] = mapped_column(Text, default="{}")
    link: Mapped[str] = mapped_column(String(1000))
    created_at: Mapped[float] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resolution_notified: Mapped[bool] = mapped_column(Boolean, default=False)
    acknowledged_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # migration 0005
    incident_id: Mapped[int | None] = mapped_column(  # migration 0008
        Integer, ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True, index=True
    )


class Incident(Base):
    """Findings of one cause in one run, grouped (gradwatch.server.alerts.incidents): notified once,
    updated as rules join or resolve, resolved as one. notify_step / notify_after: when the group wait
    ends (the run reached that step, or that time passed); notified_at once it was sent."""

    __tablename__ = "incidents"
    __table_args__ = (
        Index(None, "run_id", "status"),
        Index(None, "project", "created_at"),
        Index(None, "notified_at", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(200))
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    family: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # open | resolved
    severity: Mapped[str] = mapped_column(String(16))
    cause_key: Mapped[str] = mapped_column(String(64))
    title: Mapped[str] = mapped_column(String(500))
    cause: Mapped[str] = mapped_column(Text)
    next_steps_json: Mapped[str] = mapped_column(Text, default="[]")
    rules_json: Mapped[str] = mapped_column(Text, default="[]")
    layers_json: Mapped[str] = mapped_column(Text, default="[]")  # the layers the diagnosis names
    findings_json: Mapped[str] = mapped_column(Text, default="[]")
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    notify_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    notify_after: Mapped[float | None] = mapped_column(Float, nullable=True)
    notified_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The cause people were last told (firing or update): a different one later is sent as an update.
    notified_cause_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    link: Mapped[str] = mapped_column(String(1000))
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Webhook(Base):
    """A project's subscription: alerts of the project are POSTed to url in the given format."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(200), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    format: Mapped[str] = mapped_column(String(16))  # json | slack | discord
    secret: Mapped[str | None] = mapped_column(String(500), nullable=True)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[float] = mapped_column(Float)
    send_resolved: Mapped[bool] = mapped_column(Boolean, default=False)  # migration 0008


class Delivery(Base):
    """The outbox: one POST of one rendered payload to one webhook, retried with backoff.

    status: pending → sending (claimed by one worker until claimed_until) → delivered | failed;
    a failed attempt goes back to pending with a later next_attempt_at."""

    __tablename__ = "deliveries"
    __table_args__ = (Index(None, "status", "next_attempt_at"), Index(None, "webhook_id", "id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    webhook_id: Mapped[int] = mapped_column(Integer, ForeignKey("webhooks.id", ondelete="CASCADE"))
    alert_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("alerts.id", ondelete="CASCADE"), nullable=True
    )
    incident_id: Mapped[int | None] = mapped_column(  # migration 0008
        Integer, ForeignKey("incidents.id", ondelete="CASCADE"), nullable=True
    )
    event: Mapped[str] = mapped_column(String(32))  # incident.firing | incident.resolved | test
    payload: Mapped[str] = mapped_column(Text)  # the exact body sent, rendered once at enqueue time
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    claim_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    claimed_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    response_status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)


# -- access tokens (migration 0005) -----------------------------------------------------------------


class ApiToken(Base):
    """A bearer token for one project ("*": every project) with scopes (ingest, read, admin; "*": all).
    Only the SHA-256 of the token is stored; prefix (its first characters) lets people tell tokens apart
    in listings."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(16))  # "ingest,read", "read,admin", "*"… (auth.parse_scopes)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
