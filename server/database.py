"""Engines and schema versions: connect, check the schema is at the migrations' head, upgrade it.

A new, empty database is migrated to head automatically; one behind head is refused with the command
that upgrades it (mlflow's rule: never change a user's existing schema implicitly).

Several processes may start on one database at once (server replicas, a `gradwatch db upgrade` job).
On PostgreSQL, checking the schema and migrating it happen in one transaction that first takes an
advisory lock (pg_advisory_xact_lock, released at commit or rollback), so the starters take turns:
the first migrates, the others then find the schema at head. SQLite is not serialised this way (one
server process per SQLite file).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

import gradwatch.migrations

from .._errors import GradwatchError


class Transactions:
    """One session per transaction: commit on success, roll back on any error, always close.
    Shared by everything that writes (the store, the alert service, the outbox worker)."""

    def __init__(self, engine: Engine) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def __call__(self) -> Iterator[Session]:
        session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A read that is one snapshot (pin_snapshot): its statements all see the same commits. For
        reads only: nothing written in it is meant to last."""
        session = self._sessions()
        try:
            pin_snapshot(session)
            yield session
        finally:
            session.rollback()  # ends the read transaction (and its snapshot)
            session.close()


@contextmanager
def snapshot_session(engine: Engine) -> Iterator[Session]:
    """A read-only session of its own whose statements are one snapshot (pin_snapshot); never
    committed."""
    with Session(engine) as session:
        pin_snapshot(session)
        yield session


def pin_snapshot(session: Session) -> None:
    """Make a read session's statements one snapshot: else a batch committing between two of them is
    seen half (a series without its rollups, a run without its summary, a runs list whose count is
    not its rows, events without their points). Under PostgreSQL's READ COMMITTED each statement sees
    its own; a read-only REPEATABLE READ never fails to serialize. On SQLite the driver begins no
    transaction for SELECTs; a deferred BEGIN pins one snapshot at the first read (WAL), and a
    read-only transaction never asks for the write lock. Call before the session's first statement."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    elif dialect == "sqlite":
        session.connection().exec_driver_sql("BEGIN")


# How long a SQLite write waits for the database's one write lock before it fails (seconds). Longer
# than an admitted batch holds the lock (~2 s for the 100,000 points of server.ingest_limits' cap with
# the default alert rules, on two busy cores), shorter than the agent's 10 s request timeout: a write
# that waits this long is answered 503 with Retry-After (is_lock_timeout) while the agent still
# listens, and is retried.
SQLITE_BUSY_TIMEOUT_S = 8.0


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether a database error is SQLite giving up on its write lock ("database is locked"/"busy")."""
    if not isinstance(exc, OperationalError):
        return False
    message = str(exc.orig).lower()
    return "database is locked" in message or "database is busy" in message


class SchemaError(GradwatchError, RuntimeError):
    """The database's schema is not the one this version of gradwatch needs."""


def make_engine(database_url: str) -> Engine:
    """An engine for a sqlite:/// or postgresql+psycopg:// URL, with per-connection pragmas for SQLite."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
            cursor = dbapi_connection.cursor()
            # WAL lets readers (dashboard) proceed while an ingest transaction writes.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    if url.get_backend_name() == "postgresql":
        return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)
    raise ValueError(
        f"unsupported database URL {url.render_as_string(hide_password=True)!r}: "
        "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
    )


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(gradwatch.migrations.__file__).parent))
    return config


def head_revision() -> str:
    """The newest migration this version of gradwatch ships."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


# The advisory lock every gradwatch process takes around schema checks and migrations: one constant
# 64-bit key (the bytes of "gradwatc"), the same in every version.
SCHEMA_LOCK_KEY = int.from_bytes(b"gradwatc", "big")


def lock_schema(connection: Connection) -> None:
    """Wait for, then hold until the connection's transaction ends, the schema lock (PostgreSQL;
    a no-op on SQLite). Must be the transaction's first statement."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _upgrade(connection: Connection, revision: str) -> None:
    config = _alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to `revision` (default: head) in one transaction, holding the schema lock."""
    with engine.begin() as connection:
        lock_schema(connection)
        _upgrade(connection, revision)


def upgrade_command(database_url: str) -> str:
    """The shell command a user runs to bring `database_url` to head."""
    shown = make_url(database_url).render_as_string(hide_password=True)
    return f"gradwatch db upgrade --database-url '{shown}'"


def prepare_schema(engine: Engine, database_url: str) -> None:
    """Migrate an empty database to head; raise SchemaError for one that is behind, ahead or foreign.

    Safe to call from several processes at once (see the module docstring)."""
    head = head_revision()
    if current_revision(engine) == head:  # the usual start: no lock needed
        return
    with engine.begin() as connection:
        lock_schema(connection)
        # Read again under the lock: another process may have migrated while this one waited.
        current = MigrationContext.configure(connection).get_current_revision()
        if current == head:
            return
        if current is None:
            tables = inspect(connection).get_table_names()
            if tables:
                raise SchemaError(
                    f"the database {make_url(database_url).render_as_string(hide_password=True)} holds "
                    f"tables ({', '.join(sorted(tables)[:5])}) but no gradwatch schema version; point "
                    "gradwatch at an empty database or a gradwatch one"
                )
            _upgrade(connection, "head")
            return
    known = {rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"the database schema is at revision {current}, newer than this gradwatch knows (head {head}); "
            "upgrade gradwatch"
        )
    raise SchemaError(
        f"the database schema is at revision {current}, behind this gradwatch's {head}; "
        f"upgrade it with:\n    {upgrade_command(database_url)}"
    )
