"""A rule's state on a run is created once, even when two transactions both find none (the heartbeat
check on the server's clock and an ingest of the same run): the second waits for the first and reads
its state instead of failing on the unique key (a 500 to the agent's batch, seen in CI on PostgreSQL)."""

from __future__ import annotations

import threading
import time

from sqlalchemy.orm import Session

from gradwatch.server.database import make_engine, prepare_schema
from gradwatch.server.models import AlertRule
from gradwatch.server.schemas import RunIn
from gradwatch.server.storage import Store
from gradwatch.server.storage.alerts import rule_state_or_new


def test_two_transactions_creating_one_rule_state_share_the_first_ones(database_url):
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    try:
        Store(engine).create_run(RunIn(project="p", id="run-x"))
        with Session(engine) as session:
            rule = AlertRule(project="p", type="heartbeat", name="heartbeat", created_at=0.0, updated_at=0.0)
            session.add(rule)
            session.commit()
            rule_id = rule.id
        seen: dict[str, object] = {}

        def second() -> None:
            try:
                with Session(engine) as session:
                    state = rule_state_or_new(session, rule_id, "run-x", '{"by": "second"}', 2.0)
                    seen["state"] = state.state_json
                    session.commit()
            except Exception as exc:  # noqa: BLE001 - what the test reports
                seen["error"] = exc

        with Session(engine) as first:
            created = rule_state_or_new(first, rule_id, "run-x", '{"by": "first"}', 1.0)
            assert created.state_json == '{"by": "first"}'
            other = threading.Thread(target=second)
            other.start()
            time.sleep(0.5)
            assert other.is_alive()  # it waits for the first's uncommitted row
            first.commit()
        other.join(30)
        assert "error" not in seen, seen.get("error")
        assert seen["state"] == '{"by": "first"}'
        with Session(engine) as session:  # one row, the first's
            assert rule_state_or_new(session, rule_id, "run-x", "{}", 3.0).state_json == '{"by": "first"}'
    finally:
        engine.dispose()
