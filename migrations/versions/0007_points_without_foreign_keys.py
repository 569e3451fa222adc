"""Per-point tables without FOREIGN KEY constraints to series: checking one for every inserted row
cost as much as the insert itself. The store keeps the references intact (see server/models.py).

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLES = ("points", "vector_points", "histogram_points", "point_rollups", "vector_rollups")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"fk_{table}_series_id_series", type_="foreignkey")


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.create_foreign_key(
                f"fk_{table}_series_id_series", "series", ["series_id"], ["id"], ondelete="CASCADE"
            )
