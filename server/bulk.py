"""Bulk upserts on the driver's fast path, inside the caller's transaction.

SQLAlchemy's ORM and Core executemany build a parameter dictionary per row, which costs more than
the database's own work at ingest sizes (tens of thousands of rows per batch). Here rows are plain
tuples: SQLite gets one prepared statement run by sqlite3's executemany; PostgreSQL gets COPY into a
temporary table and one INSERT ... SELECT ... ON CONFLICT (psycopg 3), a single round trip of data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.orm import Session


def upsert(
    executor: Session | Connection,
    table: Table,
    columns: Sequence[str],
    key: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
) -> None:
    """INSERT rows (tuples in `columns` order) into `table`; a row whose `key` exists replaces the
    stored row's other columns."""
    if not rows:
        return
    connection = executor.connection() if isinstance(executor, Session) else executor
    names = ", ".join(columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    conflict = f"ON CONFLICT ({', '.join(key)}) DO " + (f"UPDATE SET {updates}" if updates else "NOTHING")
    if connection.dialect.name == "sqlite":
        placeholders = ", ".join("?" for _ in columns)
        connection.exec_driver_sql(f"INSERT INTO {table.name} ({names}) VALUES ({placeholders}) {conflict}", rows)
        return
    staging = f"_staging_{table.name}"
    cursor = connection.connection.driver_connection.cursor()
    try:
        # A temporary table lives for the session (connection); ON COMMIT DELETE ROWS empties it.
        cursor.execute(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {staging} "
            f"(LIKE {table.name} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        with cursor.copy(f"COPY {staging} ({names}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(f"INSERT INTO {table.name} ({names}) SELECT {names} FROM {staging} {conflict}")
        cursor.execute(f"TRUNCATE {staging}")  # several upserts into one table in one transaction
    finally:
        cursor.close()
