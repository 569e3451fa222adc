"""An index on events (run_id, rank, step): live streams read each rank's new events by cursor.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_events_run_id_rank_step", "events", ["run_id", "rank", "step"])


def downgrade() -> None:
    op.drop_index("ix_events_run_id_rank_step", table_name="events")
