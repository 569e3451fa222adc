"""Alerts: rules (with per-run evaluator state), alerts, webhooks and the delivery outbox.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_projects",
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("project", name="pk_alert_projects"),
    )
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("cooldown_steps", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_alert_rules_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_alert_rules"),
    )
    op.create_index("ix_alert_rules_project_run_id", "alert_rules", ["project", "run_id"])
    op.create_table(
        "alert_rule_states",
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("state_json", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rule_id"],
            ["alert_rules.id"],
            name="fk_alert_rule_states_rule_id_alert_rules",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_alert_rule_states_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("rule_id", "run_id", name="pk_alert_rule_states"),
    )
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("open_key", sa.String(100), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("occurrences", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(500), nullable=False),
        sa.Column("hint", sa.Text(), nullable=False),
        sa.Column("evidence_json", sa.Text(), nullable=False),
        sa.Column("link", sa.String(1000), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("resolved_at", sa.Float(), nullable=True),
        sa.Column("resolved_step", sa.BigInteger(), nullable=True),
        sa.Column("resolution_notified", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rule_id"], ["alert_rules.id"], name="fk_alerts_rule_id_alert_rules", ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_alerts_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_alerts"),
        sa.UniqueConstraint("open_key", name="uq_alerts_open_key"),
    )
    op.create_index("ix_alerts_project_created_at", "alerts", ["project", "created_at"])
    op.create_index("ix_alerts_run_id_step", "alerts", ["run_id", "step"])
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("secret", sa.String(500), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_webhooks"),
    )
    op.create_index("ix_webhooks_project", "webhooks", ["project"])
    op.create_table(
        "deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("webhook_id", sa.Integer(), nullable=False),
        sa.Column("alert_id", sa.Integer(), nullable=True),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Float(), nullable=False),
        sa.Column("claim_token", sa.String(64), nullable=True),
        sa.Column("claimed_until", sa.Float(), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["webhook_id"], ["webhooks.id"], name="fk_deliveries_webhook_id_webhooks", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["alert_id"], ["alerts.id"], name="fk_deliveries_alert_id_alerts", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_deliveries"),
    )
    op.create_index("ix_deliveries_status_next_attempt_at", "deliveries", ["status", "next_attempt_at"])
    op.create_index("ix_deliveries_webhook_id_id", "deliveries", ["webhook_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_deliveries_webhook_id_id", table_name="deliveries")
    op.drop_index("ix_deliveries_status_next_attempt_at", table_name="deliveries")
    op.drop_table("deliveries")
    op.drop_index("ix_webhooks_project", table_name="webhooks")
    op.drop_table("webhooks")
    op.drop_index("ix_alerts_run_id_step", table_name="alerts")
    op.drop_index("ix_alerts_project_created_at", table_name="alerts")
    op.drop_table("alerts")
    op.drop_table("alert_rule_states")
    op.drop_index("ix_alert_rules_project_run_id", table_name="alert_rules")
    op.drop_table("alert_rules")
    op.drop_table("alert_projects")
