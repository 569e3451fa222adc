"""Bulk upserts on the driver's fast path, inside the caller's transaction, in one statement.

SQLAlchemy's ORM and Core executemany build a parameter dictionary per row, which costs more than
the database's own work at ingest sizes (tens of thousands of rows per batch), and a batch makes
several upserts. Here rows are plain tuples: SQLite gets one prepared statement run by sqlite3's
executemany (in-process: no round trips); PostgreSQL gets a single INSERT ... SELECT FROM unnest(...)
with one array per column, so an upsert of any size is one round trip. (Measured for 1,000 rows
against COPY into a staging table, executemany and a multi-row VALUES list: unnest was as fast as
COPY with one statement instead of two to four, executemany took twice as long, and planning a
1,000-row VALUES list several times as long.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session


@cache
def _array_types(table: Table, columns: tuple[str, ...]) -> tuple[str, ...]:
    """PostgreSQL array types of the columns, e.g. ("INTEGER[]", "BYTEA[]")."""
    dialect = postgresql.dialect()
    return tuple(f"{table.c[name].type.compile(dialect=dialect)}[]" for name in columns)


def upsert(
    executor: Session | Connection,
    table: Table,
    columns: Sequence[str],
    key: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    update: bool = True,
) -> None:
    """INSERT rows (tuples in `columns` order) into `table`; a row whose `key` exists replaces the
    stored row's other columns (update=True) or is left alone (update=False). Rows must not repeat
    a key (PostgreSQL refuses to update one row twice in a statement)."""
    if not rows:
        return
    connection = executor.connection() if isinstance(executor, Session) else executor
    names = ", ".join(columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    action = f"UPDATE SET {updates}" if update and updates else "NOTHING"
    conflict = f"ON CONFLICT ({', '.join(key)}) DO {action}"
    if connection.dialect.name == "sqlite":
        placeholders = ", ".join("?" for _ in columns)
        connection.exec_driver_sql(f"INSERT INTO {table.name} ({names}) VALUES ({placeholders}) {conflict}", rows)
        return
    arrays = ", ".join(f"%s::{array_type}" for array_type in _array_types(table, tuple(columns)))
    cursor = connection.connection.driver_connection.cursor()
    try:
        cursor.execute(
            f"INSERT INTO {table.name} ({names}) SELECT * FROM unnest({arrays}) {conflict}",
            [list(column) for column in zip(*rows)],
        )
    finally:
        cursor.close()
