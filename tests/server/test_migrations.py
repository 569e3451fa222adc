"""Migrations are the only source of the schema: they run on SQLite and PostgreSQL and agree with
the ORM models; a stale schema is refused with the command that upgrades it."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from gradwatch.server.database import (
    SchemaError,
    current_revision,
    head_revision,
    make_engine,
    prepare_schema,
    upgrade,
)
from gradwatch.server.models import Base


def test_empty_database_is_migrated_to_head_and_matches_models(database_url):
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    assert current_revision(engine) == head_revision()
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_downgrade_to_base_and_up_again(database_url):
    from alembic import command

    from gradwatch.server.database import _alembic_config

    engine = make_engine(database_url)
    upgrade(engine)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_schema_behind_head_is_refused_with_the_upgrade_command(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    with engine.begin() as connection:  # pretend an older gradwatch created it
        connection.execute(text("UPDATE alembic_version SET version_num = 'older'"))
    with pytest.raises(SchemaError, match="newer than this gradwatch knows"):
        prepare_schema(engine, database_url)
    engine.dispose()


def test_behind_message_names_the_command(sqlite_url, monkeypatch):
    from gradwatch.server import database

    engine = make_engine(sqlite_url)
    upgrade(engine)
    # A newer gradwatch (head "0099") meets this database at our head: it must refuse, not migrate.
    real_head = head_revision()
    monkeypatch.setattr(database, "head_revision", lambda: "0099")
    monkeypatch.setattr(database, "ScriptDirectory", _ScriptsKnowing({real_head, "0099"}))
    with pytest.raises(SchemaError) as info:
        prepare_schema(engine, sqlite_url)
    assert "gradwatch db upgrade --database-url" in str(info.value)
    assert current_revision(engine) == real_head  # nothing was changed
    engine.dispose()


class _ScriptsKnowing:
    def __init__(self, revisions):
        self.revisions = revisions

    def from_config(self, _config):
        revisions = self.revisions

        class _Scripts:
            def walk_revisions(self):
                return [type("Rev", (), {"revision": r}) for r in revisions]

        return _Scripts()


def test_foreign_database_is_refused(sqlite_url):
    engine = make_engine(sqlite_url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE someone_elses (id INTEGER)"))
    with pytest.raises(SchemaError, match="no gradwatch schema version"):
        prepare_schema(engine, sqlite_url)
    engine.dispose()


def test_upgrade_to_0008_gives_existing_projects_the_new_default_rules(database_url):
    import json

    from alembic import command

    from gradwatch.server.alerts.rules import DEFAULT_RULES, make_rule
    from gradwatch.server.database import _alembic_config

    engine = make_engine(database_url)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0007")
        connection.execute(text("INSERT INTO alert_projects (project, created_at) VALUES ('old', 0)"))
        for rule_type, params in (
            ("skip_storm", {"count": 10, "window": 100, "ignore_first": 50}),
            ("scale_drop", {"factor": 8.0, "window": 100}),
        ):
            connection.execute(
                text(
                    "INSERT INTO alert_rules (project, type, name, params_json, enabled, cooldown_steps, "
                    "created_at, updated_at) VALUES ('old', :type, :type, :params, true, 100, 0, 0)"
                ),
                {"type": rule_type, "params": json.dumps(params)},
            )
        command.upgrade(config, "head")
        rows = connection.execute(
            text("SELECT type, params_json FROM alert_rules WHERE project = 'old'")
        ).all()
    by_type = {rule_type: json.loads(params) for rule_type, params in rows}
    assert set(by_type) == set(DEFAULT_RULES) - {
        "rank_disagreement",
        "heartbeat",
        "scale_floor",
        "non_finite",
    } | {"skip_storm", "scale_drop"}
    assert len(rows) == len(by_type)  # each type once
    for rule_type, params in by_type.items():
        assert make_rule(rule_type, params).values == params  # the migration's values are valid, complete
    assert by_type["skip_storm"] == {"count": 4, "window": 50, "ignore_first": 0}
    engine.dispose()


def test_upgrade_to_0009_turns_write_tokens_into_ingest_and_read(database_url):
    from alembic import command

    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import _alembic_config

    engine = make_engine(database_url)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0008")
        for scope, digest in (("write", "a" * 64), ("read", "b" * 64)):
            connection.execute(
                text(
                    "INSERT INTO api_tokens (project, scope, name, prefix, token_hash, created_at) "
                    "VALUES ('old', :scope, :scope, 'gw_x', :digest, 0)"
                ),
                {"scope": scope, "digest": digest},
            )
        connection.execute(
            text(
                "INSERT INTO runs (id, project, name, status, config_json, metadata_json, "
                "created_at, updated_at) VALUES ('r1', 'old', 'r1', 'running', '{}', '{}', 0, 0)"
            )
        )
        command.upgrade(config, "head")
    assert {(t.name, t.scope) for t in Tokens(engine).list()} == {("write", "ingest,read"), ("read", "read")}
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0008")
        scopes = dict(connection.execute(text("SELECT name, scope FROM api_tokens")).all())
        command.upgrade(config, "head")
    assert scopes == {"write": "write", "read": "read"}
    engine.dispose()


def test_upgrade_to_0013_gives_existing_projects_the_update_ratio_outlier_rule(database_url):
    import json

    from alembic import command

    from gradwatch.server.alerts.rules import make_rule
    from gradwatch.server.database import _alembic_config

    engine = make_engine(database_url)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0012")
        for project in ("old", "tuned"):
            connection.execute(
                text("INSERT INTO alert_projects (project, created_at) VALUES (:p, 0)"), {"p": project}
            )
        connection.execute(  # a project that made its own before it was a default keeps it
            text(
                "INSERT INTO alert_rules (project, type, name, params_json, enabled, cooldown_steps,"
                " created_at, updated_at)"
                " VALUES ('tuned', 'update_ratio_outlier', 'mine', :params, true, 5, 0, 0)"
            ),
            {"params": json.dumps({"factor": 100.0})},
        )
        command.upgrade(config, "head")
        rows = connection.execute(
            text(
                "SELECT project, params_json FROM alert_rules WHERE type = 'update_ratio_outlier'"
                " ORDER BY project"
            )
        ).all()
    assert [(project, json.loads(params)) for project, params in rows] == [
        ("old", make_rule("update_ratio_outlier", {}).values),
        ("tuned", {"factor": 100.0}),
    ]
    engine.dispose()


def test_upgrade_to_0015_moves_default_clip_saturation_rules_to_the_undivided_loss_test(database_url):
    """A project's default clip_saturation rule (1.25x with any accumulation: nanoGPT's normal clipping
    was told as a summed loss) moves to the new defaults; a rule tuned by hand keeps its parameters."""
    import json

    from alembic import command

    from gradwatch.server.alerts.rules import make_rule
    from gradwatch.server.database import _alembic_config

    old_default = {
        "window": 20,
        "plain_window": 200,
        "fraction": 0.9,
        "min_ratio": 3.0,
        "min_ratio_accumulating": 1.25,
    }
    tuned = {**old_default, "min_ratio_accumulating": 2.0}
    engine = make_engine(database_url)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0014")
        for project, params in (("old", old_default), ("tuned", tuned)):
            connection.execute(
                text(
                    "INSERT INTO alert_rules (project, type, name, params_json, enabled, cooldown_steps,"
                    " created_at, updated_at) VALUES (:p, 'clip_saturation', 'c', :params, true, 100, 0, 0)"
                ),
                {"p": project, "params": json.dumps(params)},
            )
        command.upgrade(config, "head")
        rows = dict(
            connection.execute(
                text("SELECT project, params_json FROM alert_rules WHERE type = 'clip_saturation'")
            ).all()
        )
        command.downgrade(config, "0014")
        back = json.loads(
            connection.execute(text("SELECT params_json FROM alert_rules WHERE project = 'old'")).scalar_one()
        )
        command.upgrade(config, "head")
    assert json.loads(rows["old"]) == make_rule("clip_saturation", {}).values
    assert json.loads(rows["tuned"]) == tuned
    assert back == old_default
    engine.dispose()
