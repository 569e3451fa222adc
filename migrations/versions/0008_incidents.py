"""Incidents (findings of one cause grouped, notified once), and the default rules that diagnose runs.

Existing projects get the new default rule types (each once), and default skip_storm rules still at
their old parameters move to the calibration-aware defaults. Rule parameters are written here as
they were at this revision, not read from the code, so the migration means the same thing later.

Revision ID: 0008
Revises: 0007
"""

import json
import time

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

NEW_DEFAULT_RULES = {  # rule type -> (params, cooldown_steps)
    "scaler_calibration": ({"floor": 1.0, "settle_steps": 25, "floor_skips": 5}, 0),
    "loss_non_finite": ({"clear_after": 100}, 0),
    "misuse": ({}, 0),
    "grad_norm_spike": ({"window": 100, "warmup": 20, "z": 6.0, "min_ratio": 10.0, "sustain": 3}, 100),
    "loss_spike": (
        {"window": 100, "warmup": 20, "z": 8.0, "min_ratio": 2.0, "sustain": 3, "restart_grace": 200},
        100,
    ),
    "lr_jump": ({"factor": 30.0, "warmup": 10}, 0),
    "clip_saturation": (
        {
            "window": 20,
            "plain_window": 200,
            "fraction": 0.9,
            "min_ratio": 3.0,
            "min_ratio_accumulating": 1.25,
        },
        100,
    ),
    "underflow": (
        {
            "threshold": 0.1,
            "zero_fraction": 0.3,
            "precision_loss": 0.5,
            "observations": 2,
            "all_zero": False,
            "key": "grad/underflow_frac",
        },
        100,
    ),
    "dead_layers": ({"observations": 2}, 100),
    "not_learning": ({"rounded_away": 0.5, "observations": 2}, 100),
}
OLD_SKIP_STORM = {"count": 10, "window": 100, "ignore_first": 50}
NEW_SKIP_STORM = {"count": 4, "window": 50, "ignore_first": 0}


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("cause_key", sa.String(64), nullable=False),
        sa.Column("title", sa.String(500), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.Column("next_steps_json", sa.Text(), nullable=False),
        sa.Column("rules_json", sa.Text(), nullable=False),
        sa.Column("layers_json", sa.Text(), nullable=False),
        sa.Column("findings_json", sa.Text(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("resolved_step", sa.BigInteger(), nullable=True),
        sa.Column("notify_step", sa.BigInteger(), nullable=True),
        sa.Column("notify_after", sa.Float(), nullable=True),
        sa.Column("notified_at", sa.Float(), nullable=True),
        sa.Column("link", sa.String(1000), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("resolved_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_incidents_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_incidents"),
    )
    op.create_index("ix_incidents_run_id_status", "incidents", ["run_id", "status"])
    op.create_index("ix_incidents_project_created_at", "incidents", ["project", "created_at"])
    op.create_index("ix_incidents_notified_at_status", "incidents", ["notified_at", "status"])
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("incident_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            "fk_alerts_incident_id_incidents", "incidents", ["incident_id"], ["id"], ondelete="SET NULL"
        )
        batch.create_index("ix_alerts_incident_id", ["incident_id"])
    with op.batch_alter_table("webhooks") as batch:
        batch.add_column(sa.Column("send_resolved", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("deliveries") as batch:
        batch.add_column(sa.Column("incident_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            "fk_deliveries_incident_id_incidents", "incidents", ["incident_id"], ["id"], ondelete="CASCADE"
        )
    _install_new_defaults()


def _install_new_defaults() -> None:
    connection = op.get_bind()
    rules = sa.table(
        "alert_rules",
        sa.column("id", sa.Integer),
        sa.column("project", sa.String),
        sa.column("run_id", sa.String),
        sa.column("type", sa.String),
        sa.column("name", sa.String),
        sa.column("params_json", sa.Text),
        sa.column("enabled", sa.Boolean),
        sa.column("cooldown_steps", sa.BigInteger),
        sa.column("created_at", sa.Float),
        sa.column("updated_at", sa.Float),
    )
    projects = [
        row[0] for row in connection.execute(sa.text("SELECT project FROM alert_projects ORDER BY project"))
    ]
    now = time.time()
    for project in projects:
        have = {
            row[0]
            for row in connection.execute(
                sa.select(rules.c.type).where(rules.c.project == project, rules.c.run_id.is_(None))
            )
        }
        for rule_type, (params, cooldown) in NEW_DEFAULT_RULES.items():
            if rule_type in have:
                continue
            connection.execute(
                rules.insert().values(
                    project=project,
                    run_id=None,
                    type=rule_type,
                    name=rule_type.replace("_", " "),
                    params_json=json.dumps(params),
                    enabled=True,
                    cooldown_steps=cooldown,
                    created_at=now,
                    updated_at=now,
                )
            )
    for rule_id, params_json in connection.execute(
        sa.select(rules.c.id, rules.c.params_json).where(rules.c.type == "skip_storm")
    ).all():
        if json.loads(params_json) == OLD_SKIP_STORM:
            connection.execute(
                rules.update()
                .where(rules.c.id == rule_id)
                .values(params_json=json.dumps(NEW_SKIP_STORM), updated_at=now)
            )


def downgrade() -> None:
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_constraint("fk_deliveries_incident_id_incidents", type_="foreignkey")
        batch.drop_column("incident_id")
    with op.batch_alter_table("webhooks") as batch:
        batch.drop_column("send_resolved")
    with op.batch_alter_table("alerts") as batch:
        batch.drop_index("ix_alerts_incident_id")
        batch.drop_constraint("fk_alerts_incident_id_incidents", type_="foreignkey")
        batch.drop_column("incident_id")
    op.drop_table("incidents")
