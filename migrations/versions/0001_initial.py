"""Initial schema: runs, scalar series and points, events, agent batches.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_index("ix_runs_project", "runs", ["project"])
    op.create_table(
        "series",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("key", sa.String(250), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_series_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_series"),
        sa.UniqueConstraint("run_id", "key", name="uq_series_run_id_key"),
    )
    op.create_table(
        "points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("flag", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["series_id"], ["series.id"], name="fk_points_series_id_series", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name="pk_points"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("data_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_events_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )
    op.create_index("ix_events_run_id_step", "events", ["run_id", "step"])
    op.create_table(
        "agent_batches",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_agent_batches_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "seq", name="pk_agent_batches"),
    )


def downgrade() -> None:
    op.drop_table("agent_batches")
    op.drop_index("ix_events_run_id_step", table_name="events")
    op.drop_table("events")
    op.drop_table("points")
    op.drop_table("series")
    op.drop_index("ix_runs_project", table_name="runs")
    op.drop_table("runs")
