"""The loss_divergence and divergence_warning default rules (the loss leaving the range it had reached,
finite or not: a divergence that stays finite raised nothing before; and its precursors, issue 38) for
projects that existed before they became defaults.

Parameters are written as they were at this revision, not read from the code, so the migration means
the same thing later. A project that already has a project-wide rule of the type keeps its own.

Revision ID: 0016
Revises: 0015
"""

import json
import time

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

RULES = {  # rule type -> params
    "loss_divergence": {
        "factor": 3.0,
        "give_back": 0.25,
        "smooth": 5,
        "baseline": 15,
        "sustain": 3,
        "warmup": 20,
        "restart_grace": 200,
    },
    "divergence_warning": {
        "factor": 1.5,
        "give_back": 0.02,
        "smooth": 5,
        "baseline": 15,
        "sustain": 3,
        "warmup": 20,
        "restart_grace": 200,
        "norm_rise": 2.0,
        "lr_rise": 2.0,
        "lr_settle": 20,
    },
}
COOLDOWN_STEPS = 100


def upgrade() -> None:
    connection = op.get_bind()
    rules = sa.table(
        "alert_rules",
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
    now = time.time()
    projects = [
        row[0]
        for row in connection.execute(sa.text("SELECT project FROM alert_projects ORDER BY project")).all()
    ]
    for rule_type, params in RULES.items():
        having = {
            row[0]
            for row in connection.execute(
                sa.select(rules.c.project).where(rules.c.type == rule_type, rules.c.run_id.is_(None))
            )
        }
        for project in projects:
            if project in having:
                continue
            connection.execute(
                rules.insert().values(
                    project=project,
                    run_id=None,
                    type=rule_type,
                    name=rule_type.replace("_", " "),
                    params_json=json.dumps(params),
                    enabled=True,
                    cooldown_steps=COOLDOWN_STEPS,
                    created_at=now,
                    updated_at=now,
                )
            )


def downgrade() -> None:
    # The rules stay: a server of an earlier revision skips a rule type it does not know (logged), and
    # deleting them would take their alerts' history with them.
    pass
