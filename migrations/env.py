"""Alembic environment: runs on the connection gradwatch.server.database passes in config.attributes."""

from alembic import context

from gradwatch.server.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # Batch mode rebuilds tables on SQLite, which cannot ALTER most things in place.
    render_as_batch=True,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
