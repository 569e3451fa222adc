"""Alembic migrations: the only way gradwatch's database schema is created or changed.

Run them with `gradwatch db upgrade [--database-url URL]`; gradwatch.server.database drives Alembic
programmatically (no alembic.ini), handing this environment an open connection.
"""
