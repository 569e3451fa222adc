"""The update_ratio_outlier default rule (one layer's update ratio far above the others': a param
group's lr typed 100x too large) for projects that existed before it became a default (issue 29).

Parameters are written as they were at this revision, not read from the code, so the migration means
the same thing later. A project that already has a project-wide rule of the type keeps its own.

Revision ID: 0013
Revises: 0012
"""

import json
import time

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

RULE_TYPE = "update_ratio_outlier"
PARAMS = {"factor": 30.0, "gap": 5.0, "observations": 1, "min_layers": 4, "max_outlier_fraction": 0.1}
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
    having = {
        row[0]
        for row in connection.execute(
            sa.select(rules.c.project).where(rules.c.type == RULE_TYPE, rules.c.run_id.is_(None))
        )
    }
    now = time.time()
    for (project,) in connection.execute(sa.text("SELECT project FROM alert_projects ORDER BY project")):
        if project in having:
            continue
        connection.execute(
            rules.insert().values(
                project=project,
                run_id=None,
                type=RULE_TYPE,
                name=RULE_TYPE.replace("_", " "),
                params_json=json.dumps(PARAMS),
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
