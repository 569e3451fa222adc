"""Bulk upserts on the driver's fast path, inside the caller's transaction, in one statement.

SQLAlchemy's ORM and Core executemany build a parameter dictionary per row, which costs more than
the database's own work at ingest sizes (tens of thousands of rows per batch), and a batch makes
several upserts. Here rows are plain tuples: SQLite gets one prepared statement run by sqlite3's
executemany (in-process: no round trips); PostgreSQL gets a single INSERT ... SELECT FROM unnest(...)
with one array per column, so an upsert of any size is one round trip. (Measured for 1,000 rows
against COPY into a staging table, executemany and a multi-row VALUES list: unnest was as fast as
COPY with one statement instead of two to four, executemany took twice as long, and planning a
1,000-row VALUES list several times as long.) Rows with binary columns go by executemany instead:
a bytea[] array literal would be escaped byte by byte in Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

from sqlalchemy import Connection, Float, Integer, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine.interfaces import DBAPICursor
from sqlalchemy.orm import Session


@cache
def _array_types(table: Table, columns: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """(PostgreSQL array type, numeric?) of each column, e.g. ("INTEGER[]", True), ("BYTEA[]", False)."""
    # SQLAlchemy leaves the dialect's __init__ unannotated (no-untyped-call is meant for our own code).
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    return tuple(
        (f"{table.c[name].type.compile(dialect=dialect)}[]", isinstance(table.c[name].type, (Integer, Float)))
        for name in columns
    )


def driver_cursor(connection: Connection) -> DBAPICursor:
    """A cursor of the driver's own connection (sqlite3, psycopg) under `connection`, in its transaction."""
    driver = connection.connection.driver_connection
    if driver is None:  # only a closed or invalidated connection has none
        raise RuntimeError("the database connection is closed")
    cursor: DBAPICursor = driver.cursor()  # the driver is untyped
    return cursor


def _numeric_array(values: Sequence[Any]) -> str:
    """A PostgreSQL array literal of ints/floats/None, built at C speed: psycopg adapts a Python
    list element by element in Python, which cost more than the insert itself (12 us a row)."""
    if None in values:
        return "{" + ",".join("NULL" if v is None else format(v) for v in values) + "}"
    return "{" + ",".join(map(format, values)) + "}"  # format: IntEnum flags as numbers


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
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    action = f"UPDATE SET {updates}" if update and updates else "NOTHING"
    _insert(executor, table, columns, rows, f"ON CONFLICT ({', '.join(key)}) DO {action}")


def insert(
    executor: Session | Connection, table: Table, columns: Sequence[str], rows: Sequence[tuple[Any, ...]]
) -> None:
    """INSERT rows that are known to be new (a key that exists is an IntegrityError): about a quarter
    cheaper than upsert on PostgreSQL, which otherwise probes the index before each row."""
    _insert(executor, table, columns, rows, "")


def _insert(
    executor: Session | Connection,
    table: Table,
    columns: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    conflict: str,
) -> None:
    if not rows:
        return
    connection = executor.connection() if isinstance(executor, Session) else executor
    names = ", ".join(columns)
    if connection.dialect.name == "sqlite":
        placeholders = ", ".join("?" for _ in columns)
        connection.exec_driver_sql(
            f"INSERT INTO {table.name} ({names}) VALUES ({placeholders}) {conflict}", rows
        )
        return
    types = _array_types(table, tuple(columns))
    cursor = driver_cursor(connection)
    try:
        if not all(numeric for _, numeric in types):
            # Rows with binary columns (point chunks, vectors, histograms: tens of rows of kilobytes
            # each): executemany, pipelined, sends bytes as they are, where a bytea[] literal would be
            # escaped byte by byte in Python.
            placeholders = ", ".join("%s" for _ in columns)
            cursor.executemany(f"INSERT INTO {table.name} ({names}) VALUES ({placeholders}) {conflict}", rows)
            return
        arrays = ", ".join(f"%s::{array_type}" for array_type, _ in types)
        parameters = [_numeric_array(column) for column in zip(*rows, strict=True)]
        cursor.execute(
            f"INSERT INTO {table.name} ({names}) SELECT * FROM unnest({arrays}) {conflict}", parameters
        )
    finally:
        cursor.close()


def delete_keys(
    executor: Session | Connection, table: Table, key: Sequence[str], rows: Sequence[tuple[Any, ...]]
) -> None:
    """DELETE the rows of `table` whose `key` columns equal one of `rows` (tuples in `key` order), in
    one statement: executemany on SQLite (in-process), a join with unnest(...) on PostgreSQL."""
    if not rows:
        return
    connection = executor.connection() if isinstance(executor, Session) else executor
    if connection.dialect.name == "sqlite":
        where = " AND ".join(f"{name} = ?" for name in key)
        connection.exec_driver_sql(f"DELETE FROM {table.name} WHERE {where}", rows)
        return
    types = _array_types(table, tuple(key))
    arrays = ", ".join(f"%s::{array_type}" for array_type, _ in types)
    cursor = driver_cursor(connection)
    try:
        cursor.execute(
            f"DELETE FROM {table.name} WHERE ({', '.join(key)}) IN (SELECT * FROM unnest({arrays}))",
            [_numeric_array(column) for column in zip(*rows, strict=True)],
        )
    finally:
        cursor.close()


def _driver_sql(connection: Connection, sql: str) -> str:
    """`sql` written with ? placeholders, in the driver's own style (psycopg: %s)."""
    return sql if connection.dialect.name == "sqlite" else sql.replace("?", "%s")


def execute(
    executor: Session | Connection, sql: str, params: Sequence[Any] | list[Sequence[Any]] = ()
) -> list[tuple[Any, ...]]:
    """A statement written with ? placeholders, in the executor's transaction, through SQLAlchemy's
    driver-level path: no ORM and no SQL compilation (what a statement of every batch costs most),
    but its errors translated as for any statement (a locked SQLite database is an OperationalError,
    answered 503). `params` a list of rows: run once per row (psycopg pipelines them). Rows as tuples."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    if isinstance(params, list) and params and isinstance(params[0], (list, tuple)):
        connection.exec_driver_sql(_driver_sql(connection, sql), [tuple(row) for row in params])
        return []
    result = connection.exec_driver_sql(_driver_sql(connection, sql), tuple(params))
    return [tuple(row) for row in result.fetchall()] if result.returns_rows else []


def fetch(executor: Session | Connection, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Plain tuples straight from the driver, skipping SQLAlchemy's Row objects: queries read tens of
    thousands of rows and per-row wrapping cost more than the database's work. `sql` uses ?
    placeholders; it runs in the executor's transaction."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    cursor = driver_cursor(connection)
    try:
        cursor.execute(_driver_sql(connection, sql), params)
        return list(cursor.fetchall())
    finally:
        cursor.close()


def fetch_lazily(
    executor: Session | Connection, sql: str, params: Sequence[Any], size: int = 64
) -> Iterator[tuple[Any, ...]]:
    """fetch()'s rows, read from the driver `size` at a time: for a reader that may stop early."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    cursor = driver_cursor(connection)
    try:
        cursor.execute(_driver_sql(connection, sql), params)
        while rows := cursor.fetchmany(size):
            yield from rows
    finally:
        cursor.close()
