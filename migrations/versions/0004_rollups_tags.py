"""Rollups (pre-aggregated pyramids of scalar series and per-layer vectors) and run tags.

Existing data is rolled up here, so a database upgraded from 0003 answers queries exactly like a new one.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _rollup_columns() -> list[sa.Column]:
    return [
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "point_rollups",
        *_rollup_columns(),
        sa.Column("low_step", sa.BigInteger(), nullable=False),
        sa.Column("low_value", sa.Float(), nullable=True),
        sa.Column("low_flag", sa.SmallInteger(), nullable=False),
        sa.Column("high_step", sa.BigInteger(), nullable=False),
        sa.Column("high_value", sa.Float(), nullable=True),
        sa.Column("high_flag", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["series_id"], ["series.id"], name="fk_point_rollups_series_id_series", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("series_id", "rank", "level", "bucket", name="pk_point_rollups"),
    )
    op.create_table(
        "vector_rollups",
        *_rollup_columns(),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["series_id"], ["series.id"], name="fk_vector_rollups_series_id_series", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("series_id", "rank", "level", "bucket", name="pk_vector_rollups"),
    )
    op.create_table(
        "run_tags",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("tag", sa.String(100), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_run_tags_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "tag", name="pk_run_tags"),
    )
    op.create_index("ix_run_tags_tag", "run_tags", ["tag"])

    # Roll up the vectors an earlier version stored (a no-op on a new database), with today's rollup
    # code. Scalar points are rolled up by 0011, which moves them into chunks: today's code reads
    # points from chunks, which do not exist yet here.
    from gradwatch.server.storage.rollups import rebuild_vectors

    rebuild_vectors(op.get_bind())


def downgrade() -> None:
    op.drop_index("ix_run_tags_tag", table_name="run_tags")
    op.drop_table("run_tags")
    op.drop_table("vector_rollups")
    op.drop_table("point_rollups")
