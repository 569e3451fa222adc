"""Scalar points in chunks: point_chunks replaces points (server/storage/chunked_points.py).

One row holds up to a few thousand consecutive points of one (series, rank) as compressed arrays,
instead of one row and one index entry per point. The upgrade moves every stored point into chunks
(series by series, in bounded memory) and drops `points`; the downgrade moves them back. Rollups
are unchanged: they summarise the same points.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

from gradwatch.server.storage import chunked_points, rollups

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_PER_READ = 65_536  # points moved per statement: bounded memory for any series length


def upgrade() -> None:
    op.create_table(
        "point_chunks",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("step_data", sa.LargeBinary(), nullable=False),
        sa.Column("value_data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("series_id", "rank", "first_step", name="pk_point_chunks"),
    )
    op.create_index(
        "ix_point_chunks_series_id_rank_last_step", "point_chunks", ["series_id", "rank", "last_step"]
    )
    connection = op.get_bind()
    pairs = connection.execute(sa.text("SELECT DISTINCT series_id, rank FROM points")).all()
    for series_id, rank in pairs:
        after = -(2**63)
        while True:
            rows = connection.execute(
                sa.text(
                    "SELECT step, value, flag FROM points"
                    " WHERE series_id = :s AND rank = :r AND step > :after ORDER BY step LIMIT :n"
                ),
                {"s": series_id, "r": rank, "after": after, "n": _PER_READ},
            ).all()
            if not rows:
                break
            chunked_points.write(connection, rank, {series_id: chunked_points.Points.of_stored(rows)})
            after = rows[-1][0]
        # A database from before 0004 has points without rollups (0004 rolls up vectors only).
        rolled_up = connection.execute(
            sa.text("SELECT 1 FROM point_rollups WHERE series_id = :s AND rank = :r LIMIT 1"),
            {"s": series_id, "r": rank},
        ).first()
        if rolled_up is None:
            rollups.refresh_points_of(connection, series_id, rank)
    op.drop_table("points")


def downgrade() -> None:
    op.create_table(
        "points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("flag", sa.SmallInteger(), nullable=False),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name="pk_points"),
    )
    connection = op.get_bind()
    points = sa.table(
        "points",
        sa.column("series_id"),
        sa.column("rank"),
        sa.column("step"),
        sa.column("value"),
        sa.column("flag"),
    )
    for series_id, rank in list(chunked_points.iterate_pairs(connection)):
        for found in chunked_points.read(connection, series_id, [rank]).values():
            stored = chunked_points.rows(found)
            for lo in range(0, len(stored), _PER_READ):
                connection.execute(
                    points.insert(),
                    [
                        {"series_id": series_id, "rank": rank, "step": s, "value": v, "flag": f}
                        for s, v, f in stored[lo : lo + _PER_READ]
                    ],
                )
    op.drop_table("point_chunks")
