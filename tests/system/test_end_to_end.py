"""Agent → real uvicorn server → SQLite file / PostgreSQL → HTTP API, with a real fp16 training loop."""

import math
import os
import subprocess
import sys

import httpx
import pytest
from conftest import free_port
from training import Reference, train

import gradwatch


def test_training_run_is_stored_and_served(api_server, client):
    reference = Reference()
    overflow = (10, 11, 12)
    with gradwatch.init(project="e2e", name="fp16", server=api_server.url, flush_interval=0.05) as run:
        train(60, run=run, overflow_steps=overflow, reference=reference)
    assert run.stats.dropped_points == 0 and run.stats.last_error is None

    stored = client.get(f"/api/v1/runs/{run.id}").json()
    assert stored["status"] == "finished" and stored["last_step"] == 59
    assert stored["metadata"]["torch"] == __import__("torch").__version__

    scale = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "amp/scale"}).json()
    assert scale["steps"] == list(range(60))
    assert scale["values"] == reference.scales_after
    assert min(scale["values"]) <= max(scale["values"]) / 8  # three halvings: the drop is there

    skipped_steps = [i for i, s in enumerate(reference.skipped) if s]
    events = client.get(f"/api/v1/runs/{run.id}/events", params={"kind": "skip"}).json()
    assert [e["step"] for e in events["data"]] == skipped_steps
    assert set(overflow) <= set(skipped_steps)
    assert stored["summary"]["skips"] == len(skipped_steps)

    norms = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "grad/global_norm"}).json()
    for step, value in zip(norms["steps"], norms["values"], strict=True):
        expected = reference.global_norms[step]
        if math.isfinite(expected):
            assert value == pytest.approx(expected, rel=1e-5)
        else:
            assert value in ("NaN", "Infinity")


def test_demo_command_stores_a_dropped_scale_and_skips(tmp_path):
    """`gradwatch demo --steps N --exit` as a user runs it, then its SQLite file served again."""
    port = free_port()
    env = os.environ | {"GRADWATCH_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "gradwatch.cli", "demo", "--steps", "220", "--exit", "--port", str(port)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert f"http://127.0.0.1:{port}/dashboard/" in done.stdout
    assert (tmp_path / "demo.db").exists()

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(
        Settings(database_url=f"sqlite:///{tmp_path / 'demo.db'}"),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    try:
        with httpx.Client(base_url=server.url) as c:
            runs = c.get("/api/v1/runs").json()["data"]
            assert len(runs) == 1 and runs[0]["status"] == "finished"
            run_id = runs[0]["id"]
            skips = c.get(f"/api/v1/runs/{run_id}/events", params={"kind": "skip"}).json()["data"]
            assert len(skips) >= 3
            scale = c.get(f"/api/v1/runs/{run_id}/series", params={"key": "amp/scale"}).json()["values"]
            assert scale[-1] < max(scale)
    finally:
        server.stop()


def _read_until(process: subprocess.Popen, needle: str, timeout: float = 120.0) -> str:
    """Lines of process.stdout until one holds `needle` (the text so far), or fail after `timeout`."""
    import selectors
    import time

    seen = ""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    with selector:
        while needle not in seen:
            assert time.monotonic() < deadline and process.poll() is None, seen[-2000:]
            if selector.select(timeout=1.0):
                seen += process.stdout.readline()
    return seen


def test_gradwatch_server_prints_the_dashboards_url(tmp_path):
    port = free_port()
    env = os.environ | {"GRADWATCH_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gradwatch.cli", "server", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _read_until(process, f"the dashboard is at http://127.0.0.1:{port}/dashboard/")
    finally:
        process.terminate()
        process.communicate(timeout=30)
        process.stdout.close()


_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'gradwatch'; runpy.run_module('gradwatch.cli', run_name='__main__')"
)


def test_ctrl_c_during_the_demos_training_stops_without_a_traceback(tmp_path):
    import signal

    port = free_port()
    env = os.environ | {"GRADWATCH_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        # Ctrl-C handled as from a terminal: a pytest-xdist worker ignores SIGINT, and Python keeps an
        # inherited "ignore" (CI's demo trained on through the signal), so the handler is set first.
        [sys.executable, "-c", _WITH_CTRL_C, "demo", "--steps", "100000", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _read_until(process, "run page:")
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        process.stdout.close()
    assert process.returncode == 130, output
    assert "Traceback" not in output and "interrupted; what was logged is stored" in output


def test_tags_given_to_init_reach_the_server_and_filter_runs(api_server):
    with gradwatch.init(project="tagged", name="t", server=api_server.url, tags=["baseline", "fp16"]) as run:
        run.log({"loss": 1.0}, step=0)
    with httpx.Client(base_url=api_server.url) as client:
        listed = client.get("/api/v1/runs", params={"tag": "baseline"}).json()["data"]
        assert [r["id"] for r in listed] == [run.id] and listed[0]["tags"] == ["baseline", "fp16"]
    with pytest.raises(ValueError, match="tags"):
        gradwatch.init(project="tagged", tags=["x" * 101], mode="offline")


def test_demo_diverge_warns_then_its_guard_stops_the_run_with_the_point_to_rewind_to(tmp_path):
    """`gradwatch demo --diverge --exit` (issue 38, item 5): the restart to a 100x peak lr at step 250
    is warned first (divergence ahead), then critical findings follow; the guard stops the loop, the run
    records where (guard_stop) and the rewind point is before the warning, which the demo prints."""
    port = free_port()
    env = os.environ | {"GRADWATCH_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "gradwatch.cli", "demo", "--diverge", "--exit", "--port", str(port)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "the guard stopped training:" in done.stdout, done.stdout

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(
        Settings(database_url=f"sqlite:///{tmp_path / 'demo.db'}"),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    try:
        with httpx.Client(base_url=server.url) as c:
            [run] = c.get("/api/v1/runs").json()["data"]
            incidents = c.get("/api/v1/incidents", params={"run_id": run["id"]}).json()["data"]
            events = c.get(f"/api/v1/runs/{run['id']}/events", params={"kind": "guard_stop"}).json()["data"]
    finally:
        server.stop()
    # The warning opens an incident of its own when it was notified before the escalation, else the
    # critical findings join its incident: either way a warning came first, from step 250 on.
    warned = min(i["first_step"] for i in incidents if "divergence_warning" in i["rules"])
    assert warned >= 250 and any(i["severity"] == "critical" for i in incidents)
    [stop] = events
    assert stop["data"]["severity"] == "critical" and stop["step"] < 400
    # the rewind point: before the warning that announced it, not merely before the critical findings
    assert stop["data"]["last_healthy_step"] == warned - 1
    assert f"at or before step {warned - 1}" in done.stdout
    # the API (and so the run page's cards) gives every incident of that trouble the same rewind point
    assert {i["last_healthy_step"] for i in incidents if i["family"] != "stalled"} == {warned - 1}
