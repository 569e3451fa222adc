"""The spool file on disk, apart from the Spool that writes it: where spool and dead-letter files live
(GRADWATCH_HOME, GRADWATCH_SPOOL_DIR, RUN-rankR.jsonl, RUN-rankR.dead.jsonl, and `gradwatch sync`'s
RUN-rankR.jsonl.sent beside them), how each record line is
encoded (see _spool for the format), and how a file is read back (scan, read_batch_json,
iter_spool_files). Separate from _spool because `gradwatch sync` and a resumed run read these files
without a Spool, and the format is one contract that both the writer and the readers follow.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ._wire import batch_points, dumps

DEAD_LETTER_SUFFIX = ".dead.jsonl"
SENT_SUFFIX = ".sent"

_BATCH_HEADER = re.compile(
    rb'\{"type": "batch", "run_id": "([A-Za-z0-9_.\-]{1,64})", "rank": (\d+), "seq": (\d+), '
    rb'"points": (\d+), "batch": '
)


def gradwatch_home() -> Path:
    """GRADWATCH_HOME, default ~/.gradwatch."""
    return Path(os.environ.get("GRADWATCH_HOME") or Path.home() / ".gradwatch")


def default_spool_dir() -> Path:
    """Where an online run spools what the server has not taken: GRADWATCH_SPOOL_DIR, else
    GRADWATCH_HOME/spool."""
    return Path(os.environ.get("GRADWATCH_SPOOL_DIR") or gradwatch_home() / "spool")


def offline_dir() -> Path:
    """Where an offline run writes its spool: GRADWATCH_HOME/offline."""
    return gradwatch_home() / "offline"


def spool_file_name(run_id: str, rank: int) -> str:
    return f"{run_id}-rank{rank}.jsonl"


def dead_letter_path(spool_path: Path) -> Path:
    """The dead-letter file beside a spool file: RUN-rankR.jsonl -> RUN-rankR.dead.jsonl."""
    name = spool_path.name
    return spool_path.with_name(name.removesuffix(".jsonl") + DEAD_LETTER_SUFFIX)


def is_dead_letter_file(path: Path) -> bool:
    return path.name.endswith(DEAD_LETTER_SUFFIX)


def sent_path(spool_path: Path) -> Path:
    """`gradwatch sync`'s list of the batches of a spool file the server acknowledged: FILE.sent."""
    return spool_path.with_name(spool_path.name + SENT_SUFFIX)


# -- records --------------------------------------------------------------------------------------


def _line(payload: bytes) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def run_record(run_document: dict[str, Any], created_at: float | None = None) -> bytes:
    """The line that introduces a process's batches: its run document, with `created_at` (when the run
    started, Unix seconds; ISO 8601 UTC in the line) for `gradwatch sync`, which creates the run on the
    server with it: a run uploaded later shows when it ran, not when it was uploaded."""
    if created_at is not None:
        moment = datetime.fromtimestamp(created_at, tz=timezone.utc).isoformat()
        run_document = {**run_document, "created_at": moment}
    return _line(json.dumps({"type": "run", "run": run_document}, allow_nan=False).encode())


def batch_record(run_id: str, batch: dict[str, Any], points: int) -> bytes:
    """The line of one sealed batch; the header fields let a reader index it without parsing it."""
    return encoded_batch_record(run_id, int(batch["rank"]), int(batch["seq"]), points, dumps(batch).encode())


def encoded_batch_record(run_id: str, rank: int, seq: int, points: int, body: bytes) -> bytes:
    """batch_record for a batch already encoded as JSON (one read back from a spool file)."""
    header = json.dumps(run_id)
    payload = (
        f'{{"type": "batch", "run_id": {header}, "rank": {int(rank)}, "seq": {int(seq)}, '
        f'"points": {int(points)}, "batch": '
    ).encode()
    return _line(payload + body + b"}")


def retire_record(run_id: str, rank: int, seq: int, why: str) -> bytes:
    """The line that withdraws an earlier batch line of the file (split, or moved to dead letters)."""
    document = {"type": "retire", "run_id": run_id, "rank": int(rank), "seq": int(seq), "why": why}
    return _line(json.dumps(document).encode())


def dead_letter_record(run_id: str, rank: int, seq: int, reason: str) -> bytes:
    """The line before a dead-lettered batch: why the server would not take it."""
    document = {"type": "dead_letter", "run_id": run_id, "rank": int(rank), "seq": int(seq), "reason": reason}
    return _line(json.dumps(document).encode())


@dataclass(frozen=True)
class Record:
    """One valid line of a spool file: where it is and what it says (batch bodies are not parsed)."""

    offset: int
    length: int
    type: str
    run_id: str | None = None
    rank: int = 0
    seq: int = -1
    points: int = 0
    run: dict[str, Any] | None = None
    reason: str | None = None  # a dead_letter record's


def _payload(line: bytes) -> memoryview | None:
    """The JSON of a line if its checksum matches, else None (torn or corrupt): a view into the line,
    not a copy (a batch line can be tens of MB)."""
    if len(line) < 11 or line[8:9] != b" " or not line.endswith(b"\n"):
        return None
    payload = memoryview(line)[9:-1]
    try:
        return payload if int(line[:8], 16) == zlib.crc32(payload) else None
    except ValueError:
        return None


def _describe(offset: int, line: bytes) -> Record | None:
    payload = _payload(line)
    if payload is None:
        return None
    header = _BATCH_HEADER.match(payload)
    if header is not None:
        run_id, rank, seq, points = header.groups()
        return Record(offset, len(line), "batch", run_id.decode(), int(rank), int(seq), int(points))
    try:
        document = json.loads(bytes(payload))  # a run, retire or dead-letter record: a short line
        return _record(offset, len(line), document) if isinstance(document, dict) else None
    except (ValueError, TypeError, KeyError, RecursionError):
        return None  # a valid checksum over fields of the wrong type: a bad line, not a stopped sync


def _record(offset: int, length: int, document: dict[str, Any]) -> Record | None:
    """A record from a line's JSON; ValueError/TypeError/KeyError where a field has the wrong type."""
    if not isinstance(document.get("run_id", ""), str):
        raise TypeError("run_id is not a string")
    if document.get("type") == "run" and isinstance(document.get("run"), dict):
        run_id = document["run"].get("id")
        return Record(offset, length, "run", run_id, run=document["run"]) if isinstance(run_id, str) else None
    if document.get("type") in ("retire", "dead_letter") and isinstance(document.get("seq"), int):
        reason = document.get("reason")
        return Record(
            offset,
            length,
            document["type"],
            document.get("run_id"),
            int(document.get("rank") or 0),
            document["seq"],
            reason=reason if isinstance(reason, str) else None,
        )
    if document.get("type") == "batch" and isinstance(document.get("batch"), dict):
        batch = document["batch"]
        return Record(
            offset,
            length,
            "batch",
            document.get("run_id"),
            int(batch.get("rank", 0)),
            int(batch["seq"]),
            batch_points(batch),
        )
    return None


@dataclass
class ScanResult:
    """The valid records of a spool file, and how many lines were torn or corrupt."""

    records: list[Record]
    bad_lines: int
    torn_tail: bool = (
        False  # the last line is unterminated and unreadable: a write the process never finished
    )

    def retired(self) -> set[tuple[str | None, int, int]]:
        """(run_id, rank, seq) of the batches a retire record withdrew: not to be sent."""
        return {(r.run_id, r.rank, r.seq) for r in self.records if r.type == "retire"}


_HEAD = 9 + 512  # a line's checksum, and its JSON far enough to hold a batch record's header
_CHUNK = 1 << 20


def scan(path: Path) -> ScanResult:
    """Read a spool file's records, streaming: a long line (a batch of tens of MB) is never held
    whole, only its head, its checksum taken piece by piece."""
    records: list[Record] = []
    bad = 0
    offset = 0
    torn = False
    with open(path, "rb") as f:
        while head := f.readline(_HEAD):
            if head.endswith(b"\n"):
                record, length, terminated = _describe(offset, head), len(head), True
            else:
                record, length, terminated = _describe_long(f, offset, head)
            if record is None:
                bad += 1
            else:
                records.append(record)
            torn = record is None and not terminated
            offset += length
    return ScanResult(records, bad, torn)


def _describe_long(f: Any, offset: int, head: bytes) -> tuple[Record | None, int, bool]:
    """A line longer than its head, read on from `f`: (its record or None, its length, whether it
    ends with a newline). Only a batch record's header is parsed; a long record of another kind (a run
    record with a large config) is read back whole."""
    checksum = zlib.crc32(head[9:])
    length = len(head)
    terminated = False
    while chunk := f.readline(_CHUNK):
        length += len(chunk)
        if chunk.endswith(b"\n"):
            checksum = zlib.crc32(memoryview(chunk)[:-1], checksum)
            terminated = True
            break
        checksum = zlib.crc32(chunk, checksum)
    if not terminated or head[8:9] != b" ":
        return None, length, terminated
    try:
        if int(head[:8], 16) != checksum:
            return None, length, True
    except ValueError:
        return None, length, True
    header = _BATCH_HEADER.match(head, 9)
    if header is not None:
        run_id, rank, seq, points = header.groups()
        return (
            Record(offset, length, "batch", run_id.decode(), int(rank), int(seq), int(points)),
            length,
            True,
        )
    resume = f.tell()
    f.seek(offset)
    line = f.read(length)
    f.seek(resume)
    return _describe(offset, line), length, True


def read_batch_json(path: Path, record: Record) -> bytes | None:
    """The wire JSON of one batch record, exactly as written; None if the bytes changed since. Only
    the batch's own bytes are held (read straight into one buffer, the checksum taken piece by piece),
    not the line and a copy of it."""
    with open(path, "rb") as f:
        f.seek(record.offset)
        head = f.read(min(record.length, 9 + 512))
        header = _BATCH_HEADER.match(head, 9) if len(head) > 11 and head[8:9] == b" " else None
        if header is not None and int(header.group(3)) == record.seq:
            size = record.length - header.end() - 2  # the line ends with the record's "}" and "\n"
            f.seek(record.offset + header.end())
            body = f.read(size) if size > 0 else b""
            if len(body) != size or size <= 0 or f.read(2) != b"}\n":
                return None
            checksum = zlib.crc32(b"}", zlib.crc32(body, zlib.crc32(head[9 : header.end()])))
            try:
                return body if int(head[:8], 16) == checksum else None
            except ValueError:
                return None
        f.seek(record.offset)
        line = f.read(record.length)  # another agent's layout: the whole line, parsed
    payload = _payload(line)
    if payload is None:
        return None
    try:
        document = json.loads(bytes(payload))
        batch = document["batch"]
    except (ValueError, KeyError, TypeError):
        return None
    return dumps(batch).encode() if batch.get("seq") == record.seq else None


def iter_spool_files(path: Path, dead_letters: bool = True) -> Iterator[Path]:
    """A spool file itself (and, with `dead_letters`, its dead-letter file when there is one), or every
    *.jsonl under a folder (dead-letter files only with `dead_letters`), in name order."""
    if path.is_dir():
        yield from sorted(
            p for p in path.rglob("*.jsonl") if _regular(p) and (dead_letters or not is_dead_letter_file(p))
        )
    else:
        if _regular(path):  # an online spool whose batches all went is gone; its dead letters stay
            yield path
        dead = dead_letter_path(path)
        if dead_letters and not is_dead_letter_file(path) and _regular(dead):
            yield dead


def _regular(path: Path) -> bool:
    """A regular file, not a link to one (a planted link would make sync write where it points) and not
    a FIFO or device (reading one would wait for ever)."""
    return path.is_file() and not path.is_symlink()
