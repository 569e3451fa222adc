"""What a newcomer meets first (issue 37, item 4): every command's --help names what each option does
and its default; a port already in use is refused with a free one to start on instead, before anything
is written; the demo keeps its runs in a database of its own, not the gradwatch.db of `gradwatch server`.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port

from gradwatch.cli import build_parser, main


def _commands(
    parser: argparse.ArgumentParser, name: str = "gradwatch"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of every command that runs something, subcommands of subcommands included."""
    nested = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not nested:
        yield name, parser
    for action in nested:
        for child_name, child in action.choices.items():
            yield from _commands(child, f"{name} {child_name}")


COMMANDS = dict(_commands(build_parser()))


def test_the_commands_are_all_found():
    assert {"gradwatch demo", "gradwatch server", "gradwatch token create", "gradwatch db upgrade"} <= set(
        COMMANDS
    )
    assert len(COMMANDS) >= 12


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_says_what_it_does_and_its_default(command):
    parser = COMMANDS[command]
    assert parser.description, f"`{command} --help` has no description"
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        assert shown.strip(), f"{command} {action.option_strings or action.dest}: no help text"
        takes_a_value = action.option_strings and action.nargs != 0
        if takes_a_value and not action.required:
            assert "default" in shown, f"{command} {action.option_strings}: no default in {shown!r}"
            if action.default not in (None, ""):
                assert str(action.default) in shown, f"{command} {action.option_strings}: {shown!r}"


def test_demo_help_names_its_defaults_and_its_own_database(capsys):
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--steps N optimizer steps to train (default: 400" in shown
    assert "(default: 127.0.0.1" in shown and "(default: 8765)" in shown
    assert "(default: 0.0)" in shown  # --step-delay
    assert "GRADWATCH_HOME/demo.db" in shown and "not the gradwatch.db" in shown
    assert "until Ctrl-C unless --exit" in shown


def _gradwatch(*arguments: str, home: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "GRADWATCH_DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gradwatch.cli", *arguments],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment | {"GRADWATCH_HOME": str(home)} | env,
    )


@pytest.mark.parametrize("command", [["demo", "--steps", "3", "--exit"], ["server"]], ids=["demo", "server"])
def test_a_port_in_use_is_refused_naming_a_free_one(command, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _gradwatch(*command, "--port", str(port), home=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr
    name = command[0]
    assert f"gradwatch {name}: port {port} on 127.0.0.1 is already in use" in done.stderr
    suggested = re.search(rf"gradwatch {name} --port (\d+)", done.stderr)
    assert suggested is not None and int(suggested.group(1)) != port, done.stderr
    if name == "demo":
        assert f'make demo ARGS="--port {suggested.group(1)}"' in done.stderr
    assert "dashboard is at" not in done.stdout  # no URL printed for a server that never started
    assert not (tmp_path / "gradwatch.db").exists() and not (tmp_path / "demo.db").exists()


def test_a_port_that_is_only_bound_is_refused_too(tmp_path):
    """A socket bound but not listening holds the port as well (as the issue's reproduction did)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done = _gradwatch("server", "--port", str(port), home=tmp_path, timeout=120)
    assert done.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in done.stderr


def test_the_demo_keeps_its_runs_in_its_own_database(tmp_path):
    done = _gradwatch("demo", "--steps", "3", "--exit", "--port", str(free_port()), home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "gradwatch.db").exists()  # the user's own database is not touched
    assert (tmp_path / "demo.db").is_file()
    assert f"database:            {tmp_path / 'demo.db'}" in done.stdout
    assert f"gradwatch server --database-url 'sqlite:///{tmp_path / 'demo.db'}'" in done.stdout


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_demo_writes_where_it_is_told(how, tmp_path):
    chosen = tmp_path / "elsewhere" / "mine.db"
    url = f"sqlite:///{chosen}"
    flag = ["--database-url", url] if how == "flag" else []
    env = {"GRADWATCH_DATABASE_URL": url} if how == "environment" else {}
    done = _gradwatch(
        "demo", "--steps", "3", "--exit", "--port", str(free_port()), *flag, home=tmp_path, **env
    )
    assert done.returncode == 0, done.stderr
    assert (
        chosen.is_file() and not (tmp_path / "demo.db").exists() and not (tmp_path / "gradwatch.db").exists()
    )
    assert f"database:            {chosen}" in done.stdout
