"""Persistence: every read and write of the runs' data, on SQLite or PostgreSQL.

    store     Store: runs, ingest, series, per-layer vectors, histograms, events; it owns each
              transaction (commit on success, rollback and translate errors otherwise)
    ranks     RankReads (Store.ranks): the ranks of distributed runs, combined at query time
    live      LiveReads (Store.live): what is new for a live stream's subscriber
    tokens    TokenStore: the access tokens' table (gradwatch.server.auth.Tokens checks them)
    rollups   the pyramids of pre-aggregated points that keep range queries cheap (maintained in
              the ingest transaction)
    bulk      upserts on the driver's fast path
    codecs    how values are stored and shown: NaN/±Inf flags, packed arrays, JSON, ISO times
    queries   query helpers shared by the above and the alert engine
    alerts    the SQL of the alert engine, incidents, outbox and service (their tables: rules,
              alerts, incidents, webhooks, deliveries), which gradwatch.server.alerts calls

Everything here returns frozen dataclasses (a live stream's cursor is the one mutable record); no
SQLAlchemy object leaves the package. The ORM tables are gradwatch.server.models, engines and
migrations gradwatch.server.database.
"""

from .live import LiveCursor, LiveEvent, LiveReads, LiveUpdate, PointsChunk
from .ranks import RankReads
from .store import (
    EventRecord,
    HistogramsResult,
    IngestResult,
    RunFilter,
    RunRecord,
    SeriesResult,
    Store,
    VectorsResult,
)
from .tokens import TokenRecord, TokenStore

__all__ = [
    "EventRecord",
    "HistogramsResult",
    "IngestResult",
    "LiveCursor",
    "LiveEvent",
    "LiveReads",
    "LiveUpdate",
    "PointsChunk",
    "RankReads",
    "RunFilter",
    "RunRecord",
    "SeriesResult",
    "Store",
    "TokenRecord",
    "TokenStore",
    "VectorsResult",
]
