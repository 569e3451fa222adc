"""The cause an incident's notification named (incidents.notified_cause_key): when later findings change
the diagnosis, the new cause is sent as an update (issue 29). Incidents notified before this revision
are taken to have named the cause they show now.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("incidents", sa.Column("notified_cause_key", sa.String(64), nullable=True))
    op.execute("UPDATE incidents SET notified_cause_key = cause_key WHERE notified_at IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("incidents") as batch:
        batch.drop_column("notified_cause_key")
