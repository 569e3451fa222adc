"""`gradwatch sync PATH`: upload spool files -- written by offline runs, or left by online runs that
ended while their server was down.

Exactly once, even when interrupted and run again: each batch in a spool keeps the seq it was sealed
with, and the server stores a (run, rank, seq) only once, acknowledging a repeat as a duplicate. A
side file `<spool>.sent` lists the seqs already acknowledged so a re-run skips them; that saves
time only -- correctness comes from the seqs. Batches go oldest first, one request each; batches a
retire record withdrew (split, or moved to dead letters by the live run) are not sent.

The run is created with the spool's run record, whose created_at (when the run started; spool files
of older agents have none) the server takes as the run's creation time. A server that refuses
that field (one older than the agent, or a time it finds implausible: a clock far off) is asked again
without it, and the run shows the sync's time, as before.

Removal: once the server has acknowledged every batch of a spool file (now or in an earlier sync: the
`.sent` list), the file and its `.sent` list are deleted and SyncReport.removed names them -- unless
keep=True (`--keep`), or the file changed during the sync. A torn last line (a write the process
never finished: nothing in it can be read) does not keep a file; other corrupt lines do, once: the
file is renamed FILE.unreadable (out of later syncs' way, kept for a look). A file with anything
refused, failed or unsent keeps everything, `.sent` list included, for the next sync. Dead-letter
files are removed the same way once synced; with dead_letters=False they are not touched.

A live run's file: the process writing a spool file holds a shared lock on it (flock), and sync takes
an exclusive one for the file's whole sync; a file in use is left to its run, which sends its own
batches (SyncReport.kept says so). Without the lock, sync could delete a file under a run that was
still appending to it.

The `.sent` list is a shortcut that trusts the server to still hold what it acknowledged: for a run the
server holds no data of (a new database, the run deleted), the list is ignored and every batch is sent.

Dead letters: by default a spool file's dead-letter file (RUN-rankR.dead.jsonl, batches the live run
moved aside after the server refused them) is synced after it, and a folder's *.dead.jsonl files
are synced with the others; dead_letters=False (`--no-dead-letters`) leaves them out. A batch the
server still refuses is reported and stays for a later sync.

Failures: no answer, 408, 429, 502, 503 and 504 are retried for up to give_up_after seconds, then the
sync stops (run it again to continue). A batch answered with another 5xx SERVER_ERROR_TRIES times in
a row is left for later and reported in `failed`, and the sync goes on -- one poison batch does not
hold back the rest -- unless FAILED_IN_A_ROW batches fail that way one after the other (the server is
failing everything: the sync stops). A 4xx (auth included: fix the token and run it again) is
reported in `refused`; neither is marked as sent.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._dead_letters import SERVER_ERROR_TRIES
from ._delivery import Kind, classify
from ._spool import (
    SENT_SUFFIX,
    Record,
    dead_letter_path,
    fcntl,
    is_dead_letter_file,
    iter_spool_files,
    read_batch_json,
    scan,
    sent_path,
)
from ._transport import Backoff, HttpTransport, TransportError

__all__ = ["SENT_SUFFIX", "SyncReport", "sync"]

FAILED_IN_A_ROW = 3  # batches failing with server errors one after the other: the sync stops


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
    failed: list[str] = field(default_factory=list)  # batches that kept failing with server errors
    dead_letters_sent: int = 0  # of batches_sent: from dead-letter files
    removed: list[str] = field(default_factory=list)  # files deleted: everything in them is stored
    kept: list[str] = field(default_factory=list)  # "FILE: why" for files not deleted though synced
    error: str | None = None  # why the sync stopped early (server unreachable for too long)

    @property
    def complete(self) -> bool:
        return self.error is None and not self.refused and not self.failed


def sync(
    path: str | os.PathLike[str],
    server: str,
    token: str | None = None,
    *,
    transport: Any = None,
    give_up_after: float = 60.0,
    max_backoff: float = 10.0,
    dead_letters: bool = True,
    server_error_tries: int = SERVER_ERROR_TRIES,
    keep: bool = False,
    log: Callable[[str], None] = print,
) -> SyncReport:
    """Upload every batch of the spool file(s) at `path` (a file, or a folder searched for *.jsonl).

    give_up_after: seconds of failed retries of one request (server down) before stopping; run the
    command again later to continue where it stopped. dead_letters: also the dead-letter files (see
    the module docstring); server_error_tries: 5xx answers in a row before a batch is left for later.
    keep: leave a file on disk once the server has stored everything in it (default: delete it, and
    its .sent list).
    """
    target = Path(path)
    if not target.exists() and not (dead_letters and dead_letter_path(target).is_file()):
        raise ValueError(
            f"no spool file or folder at {str(target)!r} (a synced file is deleted once the server has "
            "stored everything in it)"
        )
    own = transport is None
    transport = transport or HttpTransport(server, token)
    report = SyncReport()
    policy = _Policy(Backoff(base=min(0.25, max_backoff), cap=max_backoff), give_up_after, server_error_tries)
    try:
        for spool_path in iter_spool_files(target, dead_letters=dead_letters):
            report.files += 1
            _sync_file(spool_path, transport, report, policy, log, keep)
            if report.error is not None:
                break
    finally:
        if own:
            transport.close()
    return report


@dataclass
class _Policy:
    backoff: Backoff
    give_up_after: float
    server_error_tries: int
    failed_in_a_row: int = 0


def _sync_file(
    path: Path,
    transport: Any,
    report: SyncReport,
    policy: _Policy,
    log: Callable[[str], None],
    keep: bool = False,
) -> None:
    held = _exclusive_lock(path)
    if held is None:
        why = "a running process is writing it (it sends its own batches); sync it again once it ended"
        report.kept.append(f"{path}: {why}")
        log(f"{path}: kept: {why}")
        return
    try:
        _sync_locked(path, transport, report, policy, log, keep)
    finally:
        if held >= 0:
            os.close(held)


def _exclusive_lock(path: Path) -> int | None:
    """An exclusive lock on the file for its sync: its descriptor, -1 where locks are not to be had
    (not POSIX, or the file cannot be opened: the sync goes on as before), None when a live run holds
    it."""
    if fcntl is None:
        return -1
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        return -1
    return fd


def _sync_locked(
    path: Path,
    transport: Any,
    report: SyncReport,
    policy: _Policy,
    log: Callable[[str], None],
    keep: bool,
) -> None:
    before = _identity(path)
    scanned = scan(path)
    report.bad_lines += scanned.bad_lines
    # lines whose data the server cannot have (a torn last line never held a whole batch)
    unread = scanned.bad_lines - scanned.torn_tail
    retired = scanned.retired()
    dead_letter_file = is_dead_letter_file(path)
    sent_file = sent_path(path)
    already = _read_sent(sent_file)
    runs: dict[str, dict[str, Any]] = {}
    batches: dict[tuple[str, int, int], Record] = {}
    for record in scanned.records:
        if record.type == "run" and record.run_id and record.run is not None:
            runs.setdefault(record.run_id, record.run)
        elif (
            record.type == "batch"
            and record.run_id
            and (record.run_id, record.rank, record.seq) not in retired
        ):
            batches.setdefault((record.run_id, record.rank, record.seq), record)
    points_before, skipped_before = report.points_sent, report.skipped
    stored_as: dict[str, str] = {}  # the agent's run id -> the server's (they differ when the id was taken)
    empty: set[str] = set()  # runs the server has no data of (a new database): their .sent entries lie
    for run_id, document in runs.items():

        def create(document: dict[str, Any] = document, run_id: str = run_id) -> None:
            try:
                created = transport.create_run(document)
            except TransportError as exc:
                if "created_at" not in document or exc.status != 422 or "created_at" not in str(exc):
                    raise
                log(f"{path}: the server did not take the run's start time ({exc}); it shows the sync's")
                created = transport.create_run({k: v for k, v in document.items() if k != "created_at"})
            given = created.get("id") if isinstance(created, dict) else None
            stored_as[run_id] = given if isinstance(given, str) and given else run_id
            if isinstance(created, dict) and "last_step" in created and created["last_step"] is None:
                empty.add(run_id)  # the server holds nothing of it: a .sent list is stale

        if _retrying(create, policy, report, f"run {run_id}") != _OK:
            return
    send_encoded = getattr(transport, "send_encoded", None)
    stored = 0  # batches the server has acknowledged, in this sync or an earlier one
    for (run_id, rank, seq), record in sorted(batches.items(), key=lambda item: item[0][2]):
        key = f"{run_id} {rank} {seq}"
        if key in already and run_id not in empty:
            report.skipped += 1
            stored += 1
            continue
        body = read_batch_json(path, record)
        if body is None:
            report.bad_lines += 1
            unread += 1
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

        outcome = _retrying(send, policy, report, f"batch {seq} of run {run_id} rank {rank}")
        if outcome == _GAVE_UP:
            return
        if outcome == _OK:
            report.batches_sent += 1
            report.points_sent += record.points
            report.already_stored += bool(answer.get("duplicate"))
            report.dead_letters_sent += dead_letter_file
            stored += 1
            _append_sent(sent_file, key)
    skipped = report.skipped - skipped_before
    log(
        f"{path}: {report.points_sent - points_before} points uploaded"
        + (f", {skipped} batches skipped (uploaded before)" if skipped else "")
    )
    if stored == len(batches) and not keep and scanned.records:
        _remove_if_done(path, before, unread, report, log)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a file changed: (inode, size, modification time in ns); None when it is gone."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def _remove_if_done(
    path: Path,
    before: tuple[int, int, int] | None,
    unread: int,
    report: SyncReport,
    log: Callable[[str], None],
) -> None:
    """Delete a spool file whose every batch the server has acknowledged, and its .sent list -- unless
    it holds lines nothing could read, or it changed since it was scanned (a live run appending)."""
    why = None
    if unread:
        aside = path.with_name(path.name + ".unreadable")
        try:
            os.replace(path, aside)  # out of later syncs' way (they read *.jsonl), kept for a look
            sent_path(path).unlink(missing_ok=True)
        except OSError as exc:
            why = f"{unread} corrupt line(s) that could not be sent, and it cannot be set aside: {exc}"
        else:
            report.kept.append(f"{path}: {unread} corrupt line(s) could not be sent; set aside as {aside}")
            log(f"{path}: everything readable is stored; {unread} corrupt line(s) kept in {aside}")
            return
    elif before is None or _identity(path) != before:
        why = "it was written to during the sync (a run still using it?); sync it again later"
    if why is None:
        try:
            path.unlink()
        except OSError as exc:
            why = f"cannot delete it: {exc}"
    if why is not None:
        report.kept.append(f"{path}: {why}")
        log(f"{path}: kept: {why}")
        return
    try:
        sent_path(path).unlink(missing_ok=True)
    except OSError:
        pass  # left behind, it lists only batches the server acknowledged: harmless
    report.removed.append(str(path))
    log(f"{path}: removed (the server has stored everything in it)")


_OK, _REFUSED, _FAILED, _GAVE_UP = "ok", "refused", "failed", "gave up"


def _retrying(attempt: Callable[[], None], policy: _Policy, report: SyncReport, what: str) -> str:
    """Run `attempt` until it succeeds, is refused (a 4xx: message added to report.refused), fails
    with server errors policy.server_error_tries times in a row (report.failed; the sync goes on),
    or keeps failing otherwise for give_up_after seconds (report.error set)."""
    started = time.monotonic()
    policy.backoff.reset()
    server_errors = 0
    while True:
        try:
            attempt()
            policy.failed_in_a_row = 0
            return _OK
        except TransportError as exc:
            status = exc.status
            if not exc.retryable:
                report.refused.append(str(exc))
                return _REFUSED
            # A server error that is not the server being away (classify: the one status policy).
            if status is not None and classify(status).kind is Kind.SERVER_ERROR:
                server_errors += 1
                if server_errors >= policy.server_error_tries:
                    report.failed.append(f"{what}: {exc}")
                    policy.failed_in_a_row += 1
                    if policy.failed_in_a_row >= FAILED_IN_A_ROW:
                        report.error = f"the server failed {policy.failed_in_a_row} batches in a row: {exc}"
                        return _GAVE_UP
                    return _FAILED
            if time.monotonic() - started >= policy.give_up_after:
                report.error = f"server unreachable for {policy.give_up_after:.0f} s: {exc}"
                return _GAVE_UP
        time.sleep(policy.backoff.next_delay())


def _read_sent(path: Path) -> set[str]:
    if path.is_symlink():
        return set()  # not ours: a planted link (never followed, never appended to)
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    lines = text.split("\n")
    return set(lines[:-1])  # the last piece has no newline: empty, or a torn write to ignore


def _append_sent(path: Path, entry: str) -> None:
    try:
        # O_NOFOLLOW: a planted link named like the .sent list must not make sync append where it points
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.write(fd, (entry + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a read-only location: a re-run resends, and the server recognises the duplicates
