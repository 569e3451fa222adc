"""`gradwatch runs | alerts | show | export` as a user runs them (subprocesses, `python -m gradwatch.cli`
and the installed console script) against a real server holding a real fp16 training run."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import api_only_server, free_port
from training import Reference, same_stored, train

import gradwatch
from gradwatch.api import Api

GRADWATCH = str(Path(sys.executable).with_name("gradwatch"))  # the console script of this environment


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("GRADWATCH_SERVER", "GRADWATCH_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "gradwatch.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean | (env or {}),
        cwd=cwd,
        check=False,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-read")
    servers = api_only_server(f"sqlite:///{tmp / 'gradwatch.db'}")
    server = next(servers)
    reference = Reference()
    options = {"server": server.url, "flush_interval": 0.05, "spool_dir": tmp / "spool"}
    with gradwatch.init(
        project="cli", name="fp16-cli", tags=["baseline"], config={"lr": 0.01}, **options
    ) as run:
        train(30, run=run, overflow_steps=(4,), reference=reference)
        run.log({"eval/acc": 0.25}, step=19)
    with gradwatch.init(project="cli-other", name="second", **options) as second:
        second.log({"loss": 3.0}, step=0)
    yield {"url": server.url, "run": run, "second": second, "reference": reference}
    next(servers, None)  # stops it


def test_runs_table_and_json(served):
    done = cli("runs", "--server", served["url"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["id", "project", "name", "status", "last", "step", "created", "tags"]
    assert served["run"].id in done.stdout and "fp16-cli" in done.stdout and "second" in done.stdout
    column = lines[0].index("status")  # aligned: each row's status starts under the header
    assert {line[column:].split()[0] for line in lines[1:]} == {"finished"}

    listed = json.loads(cli("runs", "--server", served["url"], "--json").stdout)
    assert [r["id"] for r in listed] == [r.id for r in Api(served["url"]).runs()]
    assert listed[-1]["tags"] == ["baseline"] and listed[-1]["last_step"] == 29

    only = json.loads(cli("runs", "--server", served["url"], "--project", "cli", "--json").stdout)
    assert [r["name"] for r in only] == ["fp16-cli"]
    crashed = cli("runs", "--server", served["url"], "--status", "crashed")
    assert crashed.returncode == 0 and "(no runs match)" in crashed.stdout
    newest = cli("runs", "--server", served["url"], "--limit", "1")
    assert "second" in newest.stdout and "fp16-cli" not in newest.stdout and "--limit" in newest.stdout


def test_alerts_table_and_json(served):
    done = cli("alerts", "--server", served["url"], "--project", "cli")
    assert done.returncode == 0, done.stderr
    assert "loss_non_finite" in done.stdout and "open" in done.stdout and "fp16-cli" in done.stdout
    alerts = json.loads(cli("alerts", "--server", served["url"], "--json", "--state", "open").stdout)
    nan = next(a for a in alerts if a["type"] == "loss_non_finite")
    assert nan["run_id"] == served["run"].id and nan["status"] == "firing" and nan["step"] == 4
    resolved = cli("alerts", "--server", served["url"], "--state", "resolved")
    assert resolved.returncode == 0 and "(no alerts)" in resolved.stdout
    assert cli("alerts", "--server", served["url"], "--state", "closed").returncode == 2  # argparse


def test_show(served):
    reference, run = served["reference"], served["run"]
    done = cli("show", "fp16-cli", "--server", served["url"])  # by name
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert run.id in out and "finished" in out and "baseline" in out and "lr=0.01" in out
    table = [line.split() for line in out.splitlines()]
    assert ["loss", "29", f"{reference.losses[29]:.6g}"] in table  # key, step, last value
    assert ["loss", "scale", f"{reference.scales_after[-1]:.6g}"] in table
    assert "eval/acc" not in out  # namespaced keys: only the agent's main ones by default
    assert "amp/scale" in out and "open alerts (" in out and "loss_non_finite" in out

    shown = json.loads(
        cli("show", run.id, "--server", served["url"], "--json", "--keys", "loss,eval/acc").stdout
    )
    assert shown["run"]["id"] == run.id
    assert shown["last_values"] == {
        "loss": {"step": 29, "value": reference.losses[29]},
        "eval/acc": {"step": 19, "value": 0.25},
    }
    assert any(a["type"] == "loss_non_finite" for a in shown["open_alerts"])


def test_export_csv_round_trips_exactly(served, tmp_path):
    run = served["run"]
    done = cli("export", run.id, "--server", served["url"], "--format", "csv", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    path = tmp_path / f"{run.id}.csv"  # the default file name
    assert str(path.name) in done.stdout and "30 rows" in done.stdout
    with open(path, newline="") as file:
        table = list(csv.reader(file))
    keys = table[0][1:]
    expected = Api(served["url"]).run(run.id).history(keys, as_frame=False)
    assert keys == Api(served["url"]).run(run.id).keys() and "amp/scale" in keys
    assert len(table) - 1 == len(expected) == 30
    for cells, row in zip(table[1:], expected, strict=True):
        assert int(cells[0]) == row["step"]
        for cell, key in zip(cells[1:], keys, strict=True):
            assert same_stored(None if cell == "" else float(cell), row[key]), (row["step"], key, cell)
    losses = [float(cells[keys.index("loss") + 1]) for cells in table[1:]]
    assert all(same_stored(a, b) for a, b in zip(losses, served["reference"].losses, strict=True))

    chosen = cli("export", run.id, "--server", served["url"], "--keys", "loss,eval/acc", "-o", "-")
    assert chosen.returncode == 0 and "30 rows" in chosen.stderr
    rows = list(csv.DictReader(io.StringIO(chosen.stdout)))
    assert list(rows[0]) == ["step", "loss", "eval/acc"]
    assert [r["eval/acc"] for r in rows if r["eval/acc"]] == ["0.25"] and rows[19]["eval/acc"] == "0.25"
    assert rows[4]["loss"] == "nan"  # the overflowing step


def test_export_parquet(served, tmp_path):
    run = served["run"]
    target = tmp_path / "run.parquet"
    done = cli("export", run.id, "--server", served["url"], "--format", "parquet", "-o", str(target))
    try:
        from pyarrow import parquet
    except ImportError:
        assert done.returncode == 2 and "pip install pyarrow" in done.stderr
        assert not target.exists()
        return
    assert done.returncode == 0, done.stderr
    table = parquet.read_table(target).to_pydict()
    expected = Api(served["url"]).run(run.id).history(["loss"], as_frame=False)
    assert all(same_stored(a, r["loss"]) for a, r in zip(table["loss"], expected, strict=True))


def test_errors_are_one_line_with_the_reason(served):
    missing = cli("show", "no-such-run", "--server", served["url"])
    assert missing.returncode == 1 and "404" in missing.stderr and "no-such-run" in missing.stderr
    assert "Traceback" not in missing.stderr
    url = f"http://127.0.0.1:{free_port()}"
    down = cli("runs", "--server", url)
    assert down.returncode == 1 and f"cannot reach the gradwatch server at {url}" in down.stderr
    assert "Traceback" not in down.stderr
    bad = cli("runs", "--server", "localhost:8765")
    assert bad.returncode == 2 and "http://" in bad.stderr


def test_tokens_from_the_option_or_the_environment(sqlite_server, tmp_path):
    tokens = sqlite_server.server.config.app.state.tokens
    _, ingest = tokens.create("secure", "ingest")
    _, read = tokens.create("secure", "read")
    with gradwatch.init(
        project="secure",
        name="t",
        server=sqlite_server.url,
        token=ingest,
        flush_interval=0.05,
        spool_dir=tmp_path,
    ) as run:
        run.log({"loss": 0.5}, step=0)
    anonymous = cli("runs", "--server", sqlite_server.url)
    assert anonymous.returncode == 1 and "401" in anonymous.stderr and "GRADWATCH_TOKEN" in anonymous.stderr
    with_option = cli("runs", "--server", sqlite_server.url, "--token", read, "--json")
    assert with_option.returncode == 0 and [r["id"] for r in json.loads(with_option.stdout)] == [run.id]
    environment = {"GRADWATCH_SERVER": sqlite_server.url, "GRADWATCH_TOKEN": read}
    shown = cli("show", run.id, "--json", env=environment)
    assert shown.returncode == 0 and json.loads(shown.stdout)["last_values"]["loss"]["value"] == 0.5
    forbidden = cli("show", run.id, "--token", ingest, "--server", sqlite_server.url)
    assert forbidden.returncode == 1 and "read scope" in forbidden.stderr


def test_the_installed_console_script(served):
    done = subprocess.run(
        [GRADWATCH, "runs", "--json", "--project", "cli"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"GRADWATCH_SERVER": served["url"]},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in json.loads(done.stdout)] == [served["run"].id]
