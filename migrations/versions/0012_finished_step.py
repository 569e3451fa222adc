"""The history a finished run leaves: the last step stored when it finished.

runs.finished_step: set from last_step by each batch that finishes the run (None: it never finished).
A resume at or below it would replace data of a finished run, which an ingest token (what every
training job holds) may not do: it needs an admin token (storage.resumes).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch copy): runs can be a large table on SQLite.
    op.add_column("runs", sa.Column("finished_step", sa.BigInteger(), nullable=True))
    # Runs that finished before this revision: their last step is their history.
    op.execute("UPDATE runs SET finished_step = last_step WHERE status = 'finished'")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("finished_step")
