"""Per-layer data: layer names per run, one vector per step per quantity, log2 histograms.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("layers_json", sa.Text(), nullable=False, server_default="[]"))
    with op.batch_alter_table("series") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="scalar"))
    op.create_table(
        "vector_points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["series_id"], ["series.id"], name="fk_vector_points_series_id_series", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name="pk_vector_points"),
    )
    op.create_table(
        "histogram_points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("exponent_min", sa.Integer(), nullable=False),
        sa.Column("exponent_max", sa.Integer(), nullable=False),
        sa.Column("counts", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["series_id"], ["series.id"], name="fk_histogram_points_series_id_series", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name="pk_histogram_points"),
    )


def downgrade() -> None:
    op.drop_table("histogram_points")
    op.drop_table("vector_points")
    with op.batch_alter_table("series") as batch:
        batch.drop_column("kind")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("layers_json")
