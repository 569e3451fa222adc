"""Persistence: every read and write of the runs' data, on SQLite or PostgreSQL.

    store     Store: runs, ingest, series, per-layer vectors, histograms, events; it owns each
              transaction (commit on success, rollback and translate errors otherwise)
    run_records       RunRecord and RunFilter: a run as the Store returns it, the run list's filters
    run_updates       ingest's plain-SQL UPDATE of a run's row (status, last step, layers)
    batch_writes      BatchWriter: a batch's data written for one rank (ingest, and restores)
    resumes   what a resume supersedes, and the late batches of the processes it superseded
    attempts  what resumes took out of a run's default view, kept: listing, reading, restoring
    series_reads      SeriesReads: the Store's series, per-layer vector and histogram queries
    ranks     RankReads (Store.ranks): the ranks of distributed runs, combined at query time
    live      LiveReads (Store.live): what is new for a live stream's subscriber
    tokens    TokenStore: the access tokens' table (gradwatch.server.auth.Tokens checks them)
    rollups   the pyramids of pre-aggregated points that keep range queries cheap (maintained in
              the ingest transaction)
    rollup_summaries  the pyramid's shape and the scalar series' summaries (Summary, combine)
    rollup_appends    merge_new_points: folding a batch that only adds points into the pyramid
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
from .run_records import RunFilter, RunRecord
from .series_reads import HistogramsResult, SeriesResult, VectorsResult
from .store import EventRecord, IngestResult, Store
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
