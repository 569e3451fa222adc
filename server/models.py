"""ORM tables (SQLAlchemy 2, typed). The schema itself is created only by the Alembic migrations in
gradwatch.migrations; tests check that the two agree.

Non-finite floats are stored as value NULL plus an explicit flag (SQLite cannot store NaN), see Flag.
"""

from __future__ import annotations

import enum

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
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


class Series(Base):
    """One key of one run (e.g. "amp/scale", "grad/norm"); points refer to it by a small integer id.

    kind: "scalar" (points), "vector" (vector_points) or "histogram" (histogram_points)."""

    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("run_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(250))
    kind: Mapped[str] = mapped_column(String(16), default="scalar", server_default="scalar")


class Point(Base):
    __tablename__ = "points"

    series_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("series.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    flag: Mapped[int] = mapped_column(SmallInteger, default=Flag.FINITE)


class VectorPoint(Base):
    """One value per layer at one step, as little-endian float64 bytes (NaN/±Inf kept as they are)."""

    __tablename__ = "vector_points"

    series_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("series.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class HistogramPoint(Base):
    """Per-layer log2 histograms at one step: little-endian int64 counts, layers x (bins + 2)."""

    __tablename__ = "histogram_points"

    series_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("series.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    exponent_min: Mapped[int] = mapped_column(Integer)
    exponent_max: Mapped[int] = mapped_column(Integer)
    counts: Mapped[bytes] = mapped_column(LargeBinary)


class Event(Base):
    """Something that happened at a step: a skipped optimizer step ("skip"), a misuse warning…"""

    __tablename__ = "events"
    __table_args__ = (Index(None, "run_id", "step"),)

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
