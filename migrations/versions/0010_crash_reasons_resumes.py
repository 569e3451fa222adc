"""Why a run crashed, and where runs were resumed.

runs.status_reason: the agent's exception ("ValueError: loss is NaN"), a signal ("SIGTERM"), or
"no heartbeat" when the server marked a run whose every rank went silent (undone when data arrives).
An index on runs (status, updated_at) serves that sweep.

run_resumes: one row per process that resumed a run (gradwatch.init(resume=...)): from its step on,
the rank's data from earlier processes (seqs below seq_floor) is superseded, whenever it arrives.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch copy): runs can be a large table on SQLite.
    op.add_column("runs", sa.Column("status_reason", sa.String(500), nullable=True))
    op.create_index("ix_runs_status_updated_at", "runs", ["status", "updated_at"])
    op.create_table(
        "run_resumes",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seq_floor", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_run_resumes_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "seq_floor", name="pk_run_resumes"),
    )


def downgrade() -> None:
    op.drop_table("run_resumes")
    op.drop_index("ix_runs_status_updated_at", table_name="runs")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("status_reason")
