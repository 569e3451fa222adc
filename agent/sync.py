"""`gradwatch sync PATH`: upload spool files -- written by offline runs, or left by online runs that
ended while their server was down.

Exactly once, even when interrupted and run again: each batch in a spool keeps the seq it was sealed
with, and the server stores a (run, rank, seq) only once, acknowledging a repeat as a duplicate. A
side file `<spool>.sent` lists the seqs already acknowledged so a re-run skips them; that saves
time only -- correctness comes from the seqs. Batches go oldest first, one request each.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._sender import Backoff
from ._spool import Record, iter_spool_files, read_batch_json, scan
from ._transport import HttpTransport, TransportError

SENT_SUFFIX = ".sent"


@dataclass
class SyncReport:
    """What a sync did, in batches and points (points as the agent counts them)."""

    files: int = 0
    batches_sent: int = 0
    points_sent: int = 0
    already_stored: int = 0  # batches the server had (an earlier, interrupted sync or the live run)
    skipped: int = 0  # batches listed in a .sent file: not sent again
    bad_lines: int = 0  # torn or corrupt lines, ignored
    refused: list[str] = field(default_factory=list)  # the server's message for each refused batch
    error: str | None = None  # why the sync stopped early (server unreachable for too long)

    @property
    def complete(self) -> bool:
        return self.error is None and not self.refused


def sync(
    path: str | os.PathLike[str],
    server: str,
    token: str | None = None,
    *,
    transport: Any = None,
    give_up_after: float = 60.0,
    max_backoff: float = 10.0,
    log: Callable[[str], None] = print,
) -> SyncReport:
    """Upload every batch of the spool file(s) at `path` (a file, or a folder searched for *.jsonl).

    give_up_after: seconds of failed retries of one request (server down) before stopping; run the
    command again later to continue where it stopped.
    """
    target = Path(path)
    if not target.exists():
        raise ValueError(f"no spool file or folder at {str(target)!r}")
    transport = transport or HttpTransport(server, token)
    report = SyncReport()
    for spool_path in iter_spool_files(target):
        report.files += 1
        _sync_file(spool_path, transport, report, Backoff(cap=max_backoff), give_up_after, log)
        if report.error is not None:
            break
    return report


def _sync_file(
    path: Path,
    transport: Any,
    report: SyncReport,
    backoff: Backoff,
    give_up_after: float,
    log: Callable[[str], None],
) -> None:
    scanned = scan(path)
    report.bad_lines += scanned.bad_lines
    sent_file = path.with_name(path.name + SENT_SUFFIX)
    already = _read_sent(sent_file)
    runs: dict[str, dict[str, Any]] = {}
    batches: dict[tuple[str, int, int], Record] = {}
    for record in scanned.records:
        if record.type == "run" and record.run_id and record.run is not None:
            runs.setdefault(record.run_id, record.run)
        elif record.type == "batch" and record.run_id:
            batches.setdefault((record.run_id, record.rank, record.seq), record)
    points_before, skipped_before = report.points_sent, report.skipped
    stored_as: dict[str, str] = {}  # the agent's run id -> the server's (they differ when the id was taken)
    for run_id, document in runs.items():

        def create(document: dict[str, Any] = document, run_id: str = run_id) -> None:
            created = transport.create_run(document)
            given = created.get("id") if isinstance(created, dict) else None
            stored_as[run_id] = given if isinstance(given, str) and given else run_id

        if _retrying(create, backoff, give_up_after, report) != _OK:
            return
    send_encoded = getattr(transport, "send_encoded", None)
    for (run_id, rank, seq), record in sorted(batches.items(), key=lambda item: item[0][2]):
        key = f"{run_id} {rank} {seq}"
        if key in already:
            report.skipped += 1
            continue
        body = read_batch_json(path, record)
        if body is None:
            report.bad_lines += 1
            continue
        answer: dict[str, Any] = {}

        def send(
            body: bytes = body, run_id: str = stored_as.get(run_id, run_id), answer: dict[str, Any] = answer
        ) -> None:
            if send_encoded is not None:
                result = send_encoded(run_id, body)
            else:
                result = transport.send_batch(run_id, json.loads(body))
            answer.update(result if isinstance(result, dict) else {})

        outcome = _retrying(send, backoff, give_up_after, report)
        if outcome == _GAVE_UP:
            return
        if outcome == _OK:
            report.batches_sent += 1
            report.points_sent += record.points
            report.already_stored += bool(answer.get("duplicate"))
            _append_sent(sent_file, key)
    skipped = report.skipped - skipped_before
    log(
        f"{path}: {report.points_sent - points_before} points uploaded"
        + (f", {skipped} batches skipped (uploaded before)" if skipped else "")
    )


_OK, _REFUSED, _GAVE_UP = "ok", "refused", "gave up"


def _retrying(attempt: Callable[[], None], backoff: Backoff, give_up_after: float, report: SyncReport) -> str:
    """Run `attempt` until it succeeds, is refused (message added to report.refused), or keeps
    failing for give_up_after seconds (report.error set)."""
    started = time.monotonic()
    backoff.reset()
    while True:
        try:
            attempt()
            return _OK
        except TransportError as exc:
            if not exc.retryable:
                report.refused.append(str(exc))
                return _REFUSED
            if time.monotonic() - started >= give_up_after:
                report.error = f"server unreachable for {give_up_after:.0f} s: {exc}"
                return _GAVE_UP
        time.sleep(backoff.next_delay())


def _read_sent(path: Path) -> set[str]:
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    lines = text.split("\n")
    return set(lines[:-1])  # the last piece has no newline: empty, or a torn write to ignore


def _append_sent(path: Path, entry: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (entry + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a read-only location: a re-run resends, and the server recognises the duplicates
