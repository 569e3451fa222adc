"""`gradwatch sync` against a real server (issue 30): a synced run shows when it ran, not when it was
uploaded, and a spool file goes once the server has stored everything in it -- never before, never
when anything failed -- while an online run that delivered everything leaves nothing behind either."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port

import gradwatch
from gradwatch._spool import Spool, dead_letter_path, scan, spool_file_name
from gradwatch._transport import HttpTransport, TransportError
from gradwatch.cli import main
from gradwatch.sync import sync

RUN = {"id": "run-1", "project": "p", "name": "n", "config": {}, "metadata": {}}


def _sent(spool: Path) -> Path:
    """The list of batches a sync has had acknowledged, beside the spool file."""
    return spool.with_name(spool.name + ".sent")


def _offline_run(home: Path) -> tuple[gradwatch.Run, Path]:
    """gradwatch.init(mode="offline") logging x = step / 4 for 30 steps; the run and its spool file."""
    run = gradwatch.init(project="p", mode="offline", spool_dir=home / "offline")
    for step in range(30):
        run.log({"x": step * 0.25}, step=step)
    run.finish()
    return run, home / "offline" / spool_file_name(run.id, 0)


def _spooled(path: Path, run_id: str, poison_at: int) -> None:
    """A spool file as an offline run writes it, one batch a step for 30 steps (x = step / 4), the
    batch of step `poison_at` with a key "poison" as well."""
    spool = Spool(path, RUN | {"id": run_id}, keep_file=True)
    for step in range(30):
        scalars = [{"key": "x", "steps": [step], "values": [step * 0.25]}]
        if step == poison_at:
            scalars.append({"key": "poison", "steps": [step], "values": [1.0]})
        spool.add({"rank": 0, "seq": step, "scalars": scalars}, len(scalars), persist=True)
    spool.close()  # as an offline run's finish does: the file is left to `gradwatch sync`


def _series(url: str, run_id: str, key: str = "x") -> dict[int, float]:
    params: dict[str, Any] = {"key": key, "max_points": 100_000}
    series = httpx.get(f"{url}/api/v1/runs/{run_id}/series", params=params, timeout=30).json()
    return dict(zip(series["steps"], series["values"], strict=True))


class _Failing(HttpTransport):
    """The real server, except for batches holding key `poison`: answered `status` (500: the server
    keeps failing them; 422: it refuses them), as a poison batch or a bad deploy would be."""

    def __init__(self, server: str, status: int) -> None:
        super().__init__(server)
        self.status = status

    def send_encoded(self, run_id: str, body: bytes) -> dict[str, Any]:
        if b'"poison"' in body:
            raise TransportError(
                f"POST /batches: HTTP {self.status}: injected", self.status >= 500, self.status
            )
        return super().send_encoded(run_id, body)


# -- the run's creation time ---------------------------------------------------------------------------


def test_a_synced_offline_run_shows_when_it_ran_not_when_it_was_uploaded(tmp_path, sqlite_server):
    from gradwatch.dashboard.pages.run_views import run_header
    from gradwatch.dashboard.views import format_time

    started = time.time()
    run, spool = _offline_run(tmp_path)
    ended = time.time()
    [record] = [r for r in scan(spool).records if r.type == "run"]
    assert record.run is not None and started <= datetime.fromisoformat(record.run["created_at"]).timestamp()

    assert sync(spool, sqlite_server.url, log=lambda _line: None).complete
    info = gradwatch.Api(sqlite_server.url).run(run.id)
    assert info.created_at is not None and started <= info.created_at.timestamp() <= ended  # not the sync's
    assert info.status == "finished" and len(_series(sqlite_server.url, run.id)) == 30
    header = json.dumps(run_header(info.raw, {}).to_plotly_json(), default=str)
    assert format_time(info.raw["created_at"]) in header  # the run page shows the same time


def test_a_run_recorded_hours_ago_is_listed_by_when_it_ran(tmp_path, sqlite_server):
    # A spool written three hours ago (the Spool takes its start time as a parameter), synced after
    # a run created online now: the run list, newest first, puts the synced run second.
    three_hours_ago = time.time() - 3 * 3600
    spool = Spool(
        tmp_path / "old-rank0.jsonl", RUN | {"id": "old"}, keep_file=True, created_at=three_hours_ago
    )
    spool.add(
        {"rank": 0, "seq": 0, "scalars": [{"key": "x", "steps": [0], "values": [1.0]}]}, 1, persist=True
    )
    spool.close()
    api = gradwatch.Api(sqlite_server.url)
    online = HttpTransport(sqlite_server.url)
    online.create_run(RUN | {"id": "new"})
    online.close()
    assert sync(tmp_path, sqlite_server.url, log=lambda _line: None).complete
    assert [r.id for r in api.runs(project="p")] == ["new", "old"]
    old = api.run("old").created_at
    assert old is not None and abs(old.timestamp() - three_hours_ago) < 1e-3


def test_a_start_time_the_server_will_not_take_is_left_out_and_the_run_uploaded(tmp_path, sqlite_server):
    # A clock an hour fast (or an older server, which does not know the field): the server answers
    # 422 naming created_at; sync creates the run without it (the sync's time, as before) and says so.
    spool = Spool(
        tmp_path / "fast-rank0.jsonl", RUN | {"id": "fast"}, keep_file=True, created_at=time.time() + 3600
    )
    spool.add(
        {"rank": 0, "seq": 0, "scalars": [{"key": "x", "steps": [0], "values": [1.0]}]}, 1, persist=True
    )
    spool.close()
    lines: list[str] = []
    before = time.time()
    report = sync(tmp_path, sqlite_server.url, log=lines.append)
    assert report.complete and report.points_sent == 1
    created = gradwatch.Api(sqlite_server.url).run("fast").created_at
    assert created is not None and before <= created.timestamp() <= time.time()
    assert any("did not take the run's start time" in line and "created_at" in line for line in lines)


# -- removal after a complete sync ------------------------------------------------------------------------


def test_sync_removes_a_spool_file_once_the_server_has_stored_everything_in_it(
    tmp_path, sqlite_server, capsys
):
    run, spool = _offline_run(tmp_path)
    assert main(["sync", str(tmp_path / "offline"), "--server", sqlite_server.url]) == 0
    out = capsys.readouterr().out
    assert f"{spool}: removed (the server has stored everything in it)" in out
    assert "removed 1 spool file(s)" in out
    assert not spool.exists() and not _sent(spool).exists() and list((tmp_path / "offline").iterdir()) == []
    assert _series(sqlite_server.url, run.id) == {step: step * 0.25 for step in range(30)}
    # Run again: nothing left to do.
    assert main(["sync", str(tmp_path / "offline"), "--server", sqlite_server.url]) == 0
    assert "synced 0 spool file(s)" in capsys.readouterr().out
    # --keep keeps a fully synced file (and its .sent list: a re-run skips everything).
    _, kept = _offline_run(tmp_path)
    assert main(["sync", str(kept), "--server", sqlite_server.url, "--keep"]) == 0
    assert kept.exists() and _sent(kept).exists() and "removed" not in capsys.readouterr().out
    again = sync(kept, sqlite_server.url, log=lambda _line: None)
    assert again.points_sent == 0 and again.skipped > 0 and again.removed == [str(kept)] and not kept.exists()


@pytest.mark.parametrize("status", [500, 422], ids=["keeps-failing", "refused"])
def test_a_partly_synced_file_keeps_what_is_not_stored_until_a_later_sync_stores_it(
    tmp_path, sqlite_server, status
):
    spool = tmp_path / "partly-rank0.jsonl"
    _spooled(spool, "partly", poison_at=15)
    failing = _Failing(sqlite_server.url, status)
    report = sync(
        spool,
        sqlite_server.url,
        transport=failing,
        server_error_tries=1,
        max_backoff=0.01,
        log=lambda _line: None,
    )
    failing.close()
    assert not report.complete and len(report.failed if status == 500 else report.refused) == 1
    assert report.removed == [] and spool.exists() and _sent(spool).exists()
    assert set(_series(sqlite_server.url, "partly")) == set(range(30)) - {15}
    assert len(_sent(spool).read_text().splitlines()) == 29
    # The server is fixed: the next sync sends the one batch left, then removes the file.
    fixed = sync(spool, sqlite_server.url, log=lambda _line: None)
    assert fixed.complete and fixed.batches_sent == 1 and fixed.removed == [str(spool)]
    assert not spool.exists() and not _sent(spool).exists()
    assert set(_series(sqlite_server.url, "partly")) == set(range(30))


def test_a_torn_last_line_does_not_keep_a_file_and_a_corrupt_one_sets_it_aside_once(tmp_path, sqlite_server):
    # A crash in the middle of a write leaves a torn last line: nothing in it can ever be read, so it
    # does not keep a synced file for ever (it did: every later sync found it "not done").
    _, torn = _offline_run(tmp_path)
    with open(torn, "ab") as f:
        f.write(b'0badc0de {"type": "batch", "ru')
    lines: list[str] = []
    report = sync(torn, sqlite_server.url, log=lines.append)
    assert report.complete and report.bad_lines == 1 and report.removed == [str(torn)] and not torn.exists()
    # A corrupt line in the middle (a disk error): everything readable is stored, and the file is set
    # aside once as FILE.unreadable, out of later syncs' way.
    _, corrupt = _offline_run(tmp_path)
    data = corrupt.read_bytes().split(b"\n")
    data[1] = data[1][:20] + b"X" + data[1][21:]
    corrupt.write_bytes(b"\n".join(data))
    report = sync(corrupt, sqlite_server.url, log=lines.append)
    aside = corrupt.with_name(corrupt.name + ".unreadable")
    assert report.bad_lines == 1 and not corrupt.exists() and aside.exists()
    assert report.kept == [f"{corrupt}: 1 corrupt line(s) could not be sent; set aside as {aside}"]
    assert sync(tmp_path, sqlite_server.url, log=lambda _line: None).files == 0  # not picked up again


def test_a_file_written_during_the_sync_is_kept(tmp_path, sqlite_server):

    # A run still appending to its file while the sync runs: what it adds is not stored yet.
    _, live = _offline_run(tmp_path)

    class Appending(HttpTransport):
        def create_run(self, run: dict[str, Any]) -> dict[str, Any]:
            Spool(live, run, keep_file=True).add(
                {"rank": 0, "seq": 10**6, "scalars": [{"key": "late", "steps": [99], "values": [1.0]}]},
                1,
                persist=True,
            )
            return super().create_run(run)

    appending = Appending(sqlite_server.url)
    written = sync(live, sqlite_server.url, transport=appending, log=lambda _line: None)
    appending.close()
    assert written.complete and written.removed == [] and live.exists()
    assert "written to during the sync" in written.kept[0]
    later = sync(
        live, sqlite_server.url, log=lambda _line: None
    )  # the next sync sends it, then removes the file
    assert later.batches_sent == 1 and later.removed == [str(live)]


def test_dead_letters_are_removed_once_synced_and_left_alone_without_them(tmp_path, sqlite_server):
    spool = tmp_path / "dl-rank0.jsonl"
    from gradwatch._spool import DeadLetters

    batch = b'{"rank": 0, "seq": 7, "scalars": [{"key": "x", "steps": [3], "values": [2.0]}]}'
    DeadLetters(dead_letter_path(spool), RUN | {"id": "dl"}).add(
        7, batch, 1, "HTTP 500: the server was broken"
    )
    assert sync(tmp_path, sqlite_server.url, dead_letters=False, log=lambda _line: None).files == 0
    assert dead_letter_path(spool).exists()
    report = sync(spool, sqlite_server.url, log=lambda _line: None)
    assert (
        report.complete and report.dead_letters_sent == 1 and report.removed == [str(dead_letter_path(spool))]
    )
    assert not dead_letter_path(spool).exists() and _series(sqlite_server.url, "dl") == {3: 2.0}


# -- the online case ---------------------------------------------------------------------------------------


def test_an_online_run_that_delivered_everything_leaves_no_spool_behind(tmp_path, sqlite_url):
    # The server is down when the run starts: batches go to the spool file. A partial `gradwatch
    # sync` of it left a .sent list. The server comes back and the run delivers everything: the
    # file and the list go (the dead-letter file would stay, for sync; there is none here).
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run = gradwatch.init(project="p", server=url, spool_dir=tmp_path, max_backoff=0.1, flush_interval=0.05)
    spool = tmp_path / spool_file_name(run.id, 0)
    steps = 0
    deadline = time.monotonic() + 30
    while (steps < 20 or not spool.exists()) and time.monotonic() < deadline:
        run.log({"x": float(steps)}, step=steps)
        steps += 1
        time.sleep(0.02)
    assert spool.exists()
    _sent(spool).write_text(f"{run.id} 0 999\n")
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(Settings(database_url=sqlite_url), "127.0.0.1", port, with_dashboard=False)
    server.start()
    try:
        run.finish()
        assert run.stats.sent == steps and run.stats.spooled == 0
        assert not spool.exists() and not _sent(spool).exists() and list(tmp_path.glob("*.jsonl*")) == []
        assert set(_series(url, run.id)) == set(range(steps))
    finally:
        server.stop()
