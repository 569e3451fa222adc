"""Default clip_saturation rules still at their old parameters move to the new defaults (issue 37): with
gradient accumulation, saturated clipping names an undivided loss only at a median pre-clip norm of at
least max(min_ratio_accumulating, undivided_share x micro-batches) times max_norm. The old default (1.25x
whatever the micro-batch count) told nanoGPT's normal clipping (loss / 8, clip 1.0, ~1.35x) as a summed
loss. A rule whose parameters were changed by hand keeps them.

Parameters are written as they were at this revision, not read from the code, so the migration means
the same thing later.

Revision ID: 0015
Revises: 0014
"""

import json
import time

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

RULE_TYPE = "clip_saturation"
OLD_PARAMS = {
    "window": 20,
    "plain_window": 200,
    "fraction": 0.9,
    "min_ratio": 3.0,
    "min_ratio_accumulating": 1.25,
}
NEW_PARAMS = {**OLD_PARAMS, "min_ratio_accumulating": 3.0, "undivided_share": 0.5}


def _rules() -> sa.TableClause:
    return sa.table(
        "alert_rules",
        sa.column("id", sa.Integer),
        sa.column("type", sa.String),
        sa.column("params_json", sa.Text),
        sa.column("updated_at", sa.Float),
    )


def _move(old: dict[str, float], new: dict[str, float]) -> None:
    connection, rules = op.get_bind(), _rules()
    now = time.time()
    for rule_id, params_json in connection.execute(
        sa.select(rules.c.id, rules.c.params_json).where(rules.c.type == RULE_TYPE)
    ).all():
        if json.loads(params_json) == old:
            connection.execute(
                rules.update()
                .where(rules.c.id == rule_id)
                .values(params_json=json.dumps(new), updated_at=now)
            )


def upgrade() -> None:
    _move(OLD_PARAMS, NEW_PARAMS)


def downgrade() -> None:
    # An earlier revision's server refuses a parameter it does not know (undivided_share).
    _move(NEW_PARAMS, OLD_PARAMS)
