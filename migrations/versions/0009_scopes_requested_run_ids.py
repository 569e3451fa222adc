"""Token scopes ingest / read / admin, and run ids that one project cannot take from another.

Tokens: "write" meant everything a project allows; it becomes "ingest,read", what its holders (training
jobs, dashboards) use. Administering (rules, webhooks, deletes, renames, acknowledgements) now needs an
admin token that an operator creates on purpose. "read" stays "read".

Runs: an agent names its run; when that id is already another project's, the run is stored under a
fresh id and `requested_id` keeps the agent's, so each project's runs are found by the id its agents
asked for (unique per project) and no project can squat another's ids.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.text("UPDATE api_tokens SET scope = 'ingest,read' WHERE scope = 'write'"))
    # Plain ADD COLUMN (no batch copy): runs can be a large table on SQLite.
    op.add_column("runs", sa.Column("requested_id", sa.String(64), nullable=True))
    op.create_index("uq_runs_project_requested_id", "runs", ["project", "requested_id"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_runs_project_requested_id", table_name="runs")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("requested_id")
    # Before 0009, ingesting and administering both needed write.
    op.execute(sa.text("UPDATE api_tokens SET scope = 'write' WHERE scope <> 'read'"))
