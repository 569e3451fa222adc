"""divergence_warning's norm_climb parameter (issue 38: a warm-up that ramps too fast) written into the
stored divergence_warning rules that lack it, so a stored rule's parameters stay complete.

The value is written as it was at this revision (3.0), not read from the code. A rule whose parameters
already name it keeps its own. Downgrade takes the key out again.

Revision ID: 0018
Revises: 0017
"""

import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

NORM_CLIMB = 3.0

_rules = sa.table(
    "alert_rules",
    sa.column("id", sa.Integer),
    sa.column("type", sa.String),
    sa.column("params_json", sa.Text),
)


def _rewrite(change: Callable[[dict[str, Any]], bool]) -> None:
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(_rules.c.id, _rules.c.params_json).where(_rules.c.type == "divergence_warning")
    ).all()
    for rule_id, params_json in rows:
        params = json.loads(params_json or "{}")
        if change(params):
            connection.execute(
                _rules.update().where(_rules.c.id == rule_id).values(params_json=json.dumps(params))
            )


def upgrade() -> None:
    def add(params: dict[str, Any]) -> bool:
        if "norm_climb" in params:
            return False
        params["norm_climb"] = NORM_CLIMB
        return True

    _rewrite(add)


def downgrade() -> None:
    _rewrite(lambda params: params.pop("norm_climb", None) is not None)
