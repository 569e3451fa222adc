"""The spool: sealed batches waiting for the server, always handed out oldest (lowest seq) first.

A batch stays in memory while the server keeps up; it is written to the spool file once the server
fails, when memory holds too many points, or when the run closes with it unsent. The file is
append-only text, one record a line:

    <crc32 of the JSON, 8 hex digits> <JSON>\\n

    {"type": "run", "run": {...run document..., "created_at": ISO 8601}}
                                  written before a process's first batch; created_at: when the run
                                  started, which `gradwatch sync` gives the server when it creates the run
    {"type": "batch", "run_id": ID, "rank": R, "seq": S, "points": P, "batch": {...wire batch...}}
    {"type": "retire", "run_id": ID, "rank": R, "seq": S, "why": "split" | "dead_letter"}
                                  batch S above is not to be sent: it was split into smaller batches
                                  (written before this line) or moved to the dead-letter file
    {"type": "dead_letter", "run_id": ID, "rank": R, "seq": S, "reason": TEXT}
                                  (dead-letter files only) why the next line's batch was moved there

Every record is one os.write on an O_APPEND descriptor, so a crash can only tear the last line; a line
whose checksum does not match or that lacks its newline is skipped, and a writer that finds the file
not ending in a newline ends it first, so torn bytes never join a new record. There is one file per
(run, rank); several processes of one run (a resumed job) append to it in turn. Batches keep the seq
they were sealed with, so a replay -- by a resumed run at start, or by `gradwatch sync FILE` -- is
stored once by the server. The file is size-capped (one warning when full); beyond the cap, and
when it cannot be written at all (one warning), batches stay in memory up to a bound, and beyond
that they are dropped and counted, never silently.

Durability: a written batch is fsynced at most `fsync_interval` (1 s) later -- sync_due(), called by
the sender's collector thread, fsyncs a file written since its last fsync once that long has passed
-- so a power cut loses about the last second of spooled data at most (a process crash loses none:
the bytes are in the OS). Batches the server refuses for good (see the sender) go to a dead-letter
file beside the spool, `RUN-rankR.dead.jsonl`, in the same format, for `gradwatch sync`.

Removal: an online run's file goes once the server has acknowledged every batch in it (with the
`.sent` list of an earlier, partial `gradwatch sync` of it); an offline run's stays for `gradwatch
sync`, which removes it (and its `.sent` list) once the server has stored everything in it. Dead-letter
files stay for `gradwatch sync` in both cases.

Not thread-safe: the sender calls it under its own lock.
"""

from __future__ import annotations

import heapq
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ._spool_file import (
    DEAD_LETTER_SUFFIX,
    SENT_SUFFIX,
    Record,
    ScanResult,
    batch_record,
    dead_letter_path,
    dead_letter_record,
    default_spool_dir,
    encoded_batch_record,
    gradwatch_home,
    is_dead_letter_file,
    iter_spool_files,
    offline_dir,
    read_batch_json,
    retire_record,
    run_record,
    scan,
    sent_path,
    spool_file_name,
)

fcntl: ModuleType | None
try:
    import fcntl  # advisory locks: POSIX only (elsewhere sync and a live run are not told apart)
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# The file's places, records and readers live in _spool_file; the agent and the tests import them from here.
__all__ = [
    "DEAD_LETTER_SUFFIX",
    "DEFAULT_FSYNC_INTERVAL",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_MEMORY_POINTS",
    "SENT_SUFFIX",
    "DeadLetters",
    "Record",
    "ScanResult",
    "Spool",
    "batch_record",
    "dead_letter_path",
    "dead_letter_record",
    "default_spool_dir",
    "encoded_batch_record",
    "gradwatch_home",
    "is_dead_letter_file",
    "iter_spool_files",
    "offline_dir",
    "read_batch_json",
    "retire_record",
    "run_record",
    "scan",
    "sent_path",
    "spool_file_name",
]

logger = logging.getLogger("gradwatch")

DEFAULT_MAX_BYTES = 1 << 30  # spool file cap: 1 GiB
# Points kept in memory when they cannot go to disk (~70 bytes each as Python objects: ~35 MB).
DEFAULT_MAX_MEMORY_POINTS = 500_000
# Seconds between fsyncs of a spool file that is being written: what a power cut can lose at most.
DEFAULT_FSYNC_INTERVAL = 1.0


# -- the spool ------------------------------------------------------------------------------------


@dataclass
class _Entry:
    seq: int
    points: int
    batch: dict[str, Any] | None  # in memory; None once it is only in the file
    record: Record | None = None  # in the file
    order: int = -1  # where it stands in the queue: its seq, or the seq of the batch it was split from


class Spool:
    """Sealed batches of one (run, rank) until the server has them. `path` None: memory only."""

    def __init__(
        self,
        path: Path | None,
        run_document: dict[str, Any],
        rank: int = 0,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_memory_points: int = DEFAULT_MAX_MEMORY_POINTS,
        keep_file: bool = False,
        fsync_interval: float | None = DEFAULT_FSYNC_INTERVAL,
        created_at: float | None = None,
    ) -> None:
        """fsync_interval: seconds between fsyncs of a file being written (None: never, but at close);
        created_at: when the run started (Unix seconds; default now), written in the run record."""
        if max_bytes <= 0:
            raise ValueError(f"spool max_bytes must be positive, got {max_bytes!r}")
        if fsync_interval is not None and fsync_interval < 0:
            raise ValueError(f"fsync_interval must be >= 0 seconds or None, got {fsync_interval!r}")
        self.path = path
        self.run_document = run_document
        self.run_id = run_document["id"]
        self.rank = rank
        self.max_bytes = max_bytes
        self.max_memory_points = max_memory_points
        self.keep_file = keep_file  # offline spools stay for `gradwatch sync`
        self.created_at = time.time() if created_at is None else created_at
        self.fsync_interval = fsync_interval
        self.fsyncs = 0  # fsync calls made (durability costs one per interval while the file is written)
        self.fsync_seconds = 0.0  # time spent in them
        self.memory_points = 0  # points in batches held only in memory
        self.disk_points = 0  # points in batches in the file and not yet acknowledged
        self.dropped_points = 0  # points that found room neither in the file nor in memory
        self._entries: dict[int, _Entry] = {}
        self._order: list[tuple[int, int]] = []  # heap of (order, seq); entries removed lazily
        self._run_written = False  # this process's run record is in the file
        self._disk_entries = 0  # entries whose batch is in the file
        self._file_is_ours = False  # we wrote or replayed it: ours to delete once everything is sent
        self._newline_checked = False
        self._disk_failed = False
        self._dirty = False  # written since the last fsync
        self._last_fsync = float("-inf")
        self._warned: set[str] = set()
        self._lock_fd: int | None = None  # holds a shared lock on the file while this process uses it

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def points(self) -> int:
        return self.memory_points + self.disk_points

    @property
    def writable(self) -> bool:
        """Whether batches can still go to the file."""
        return self.path is not None and not self._disk_failed

    @property
    def memory_entries(self) -> int:
        """Batches held only in memory (lost if the process ends now)."""
        return len(self._entries) - self._disk_entries

    # -- setup (on a worker thread: file system calls never run on the training thread) ----------

    def check_writable(self) -> bool:
        """Probe the spool folder once, so a read-only or missing location is reported at start."""
        if self.path is None or self._disk_failed:
            return not self._disk_failed
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path.parent):
                pass
        except OSError as exc:
            self._fail_disk(exc)
            return False
        return True

    def scan_leftovers(self) -> ScanResult | None:
        """Read what an earlier process of this run and rank left in the file. File reads only: the
        sender calls it without its lock, so a large file does not hold up the collector."""
        if self.path is None or not self.path.exists():
            return None
        try:
            return scan(self.path)
        except OSError as exc:
            self._warn_once(
                "recover",
                "gradwatch: cannot read the spool file %s (%s); its data is not replayed",
                self.path,
                exc,
            )
            return None

    def adopt(self, leftovers: ScanResult | None, older_than: int | None = None) -> int:
        """Index the leftover batches (their seqs are older, so they are sent first); `older_than`: the
        first seq of this process, whose own batches are indexed already. Batches a retire record
        withdrew are left out. Returns their points."""
        if leftovers is None:
            return 0
        found = 0
        self._file_is_ours = True
        self._hold_lock()
        retired = leftovers.retired()
        for record in leftovers.records:
            if record.type != "batch" or record.run_id != self.run_id or record.rank != self.rank:
                continue
            if record.seq in self._entries or (older_than is not None and record.seq >= older_than):
                continue  # written by this process since the scan
            if (record.run_id, record.rank, record.seq) in retired:
                continue
            self._index(_Entry(record.seq, record.points, None, record))
            self.disk_points += record.points
            self._disk_entries += 1
            found += record.points
        if leftovers.bad_lines:
            logger.warning(
                "gradwatch: spool file %s: %d torn or corrupt line(s) skipped", self.path, leftovers.bad_lines
            )
        return found

    def recover(self) -> int:
        """scan_leftovers() and adopt() in one call."""
        return self.adopt(self.scan_leftovers())

    # -- adding and persisting --------------------------------------------------------------------

    def add(self, batch: dict[str, Any], points: int, persist: bool, order: int | None = None) -> bool:
        """Hold a sealed batch; `persist` writes it to the file now. False: no room, dropped (counted).
        `order`: where it queues (default its seq; a smaller one puts it ahead of batches sealed before)."""
        seq = int(batch["seq"])
        entry = _Entry(seq, points, batch, order=seq if order is None else order)
        over_memory = self.memory_points + points > self.max_memory_points
        if (persist or over_memory) and self._write([entry]):
            self._index(entry)
            return True
        if over_memory:
            self.dropped_points += points
            self._warn_once(
                "memory",
                "gradwatch: more than %d unsent points are held in memory and the spool file cannot take "
                "more; dropping new data (counted in run.stats.dropped)",
                self.max_memory_points,
            )
            return False
        self._index(entry)
        self.memory_points += points
        return True

    def persist(self) -> None:
        """Write every batch held only in memory to the file, oldest first (as far as it has room)."""
        waiting = sorted(
            (e for e in self._entries.values() if e.record is None), key=lambda e: (e.order, e.seq)
        )
        if waiting:
            self._write(waiting)

    def fsync(self) -> None:
        """Put what was written on disk now (at close: a power cut then loses nothing written)."""
        if self._dirty:
            self._dirty = False
            self._last_fsync = time.monotonic()
            self._fsync_file()

    def sync_due(self) -> bool:
        """fsync the file if it was written since the last fsync and fsync_interval has passed since;
        True when it did. Called often (every collector pass), it fsyncs at most once an interval.
        Safe beside the sender's lock holder: it reads two flags and opens the file by name."""
        if not self._dirty or self.fsync_interval is None:
            return False
        now = time.monotonic()
        if now - self._last_fsync < self.fsync_interval:
            return False
        self._dirty = False  # before the fsync: a write landing during it marks the file again
        self._last_fsync = now
        self._fsync_file()
        return True

    def _fsync_file(self) -> None:
        if self.path is None or self._disk_failed:
            return
        started = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # gone: everything in it was sent
        try:
            os.fsync(fd)
            self.fsyncs += 1
        except OSError:
            pass
        finally:
            os.close(fd)
            self.fsync_seconds += time.perf_counter() - started

    # -- handing out ------------------------------------------------------------------------------

    def oldest(self) -> tuple[int, dict[str, Any] | bytes, int] | None:
        """(seq, batch, points) of the oldest batch: a dict, or the JSON bytes of a batch in the file."""
        while self._order:
            order, seq = self._order[0]
            entry = self._entries.get(seq)
            if entry is None or entry.order != order:
                heapq.heappop(self._order)
                continue
            if entry.batch is not None:
                return seq, entry.batch, entry.points
            body = None
            try:
                body = read_batch_json(self.path, entry.record) if self.path and entry.record else None
            except OSError:
                pass
            if body is not None:
                return seq, body, entry.points
            self.remove(seq)
            self.dropped_points += entry.points
            logger.warning(
                "gradwatch: spool file %s changed under us: batch %d (%d points) lost",
                self.path,
                seq,
                entry.points,
            )
        return None

    def upcoming(self, limit: int) -> list[tuple[int, dict[str, Any]]]:
        """(seq, batch) of the next `limit` batches held in memory, in the order they go out."""
        waiting = (e for e in self._entries.values() if e.batch is not None)
        first = heapq.nsmallest(limit, waiting, key=lambda e: (e.order, e.seq))
        return [(e.seq, e.batch) for e in first if e.batch is not None]

    def holds(self, seq: int) -> bool:
        return seq in self._entries

    def order_of(self, seq: int) -> int | None:
        entry = self._entries.get(seq)
        return None if entry is None else entry.order

    def remove(self, seq: int) -> None:
        """Forget a batch (the server has it, or refused it). An online file with nothing left goes."""
        entry = self._entries.pop(seq, None)
        if entry is None:
            return
        if entry.record is not None:
            self.disk_points -= entry.points
            self._disk_entries -= 1
        else:
            self.memory_points -= entry.points
        if not self.keep_file and self.path is not None and self._file_is_ours and not self._disk_entries:
            self._release_lock()
            for done in (self.path, sent_path(self.path)):  # .sent: an earlier partial sync's list
                try:
                    done.unlink(missing_ok=True)
                except OSError:
                    pass
            self._run_written = self._file_is_ours = False
            self._dirty = False

    def retire(self, seq: int, why: str) -> None:
        """Forget a batch that is not to be sent (moved to dead letters); if it is in the file, a
        retire record keeps a resumed run or `gradwatch sync` from sending it."""
        entry = self._entries.get(seq)
        if entry is None:
            return
        on_disk = entry.record is not None
        self.remove(seq)
        if on_disk and self._file_is_ours and self.path is not None and self.path.exists():
            self._write([], retire_record(self.run_id, self.rank, seq, why))

    def replace(self, seq: int, pieces: list[tuple[dict[str, Any], int]]) -> None:
        """Put smaller batches (`pieces`: (batch, points), each with a seq of its own) in the place of
        batch `seq`, queued where it was. A batch in the file is replaced in the file: the pieces,
        then a retire record for it, in one append."""
        entry = self._entries.get(seq)
        if entry is None:
            return
        order, on_disk = entry.order, entry.record is not None
        self.remove(seq)
        new = [_Entry(int(batch["seq"]), points, batch, order=order) for batch, points in pieces]
        written = on_disk and self._write(new, retire_record(self.run_id, self.rank, seq, "split"))
        for piece in new:
            self._index(piece)
            if piece.record is None:
                self.memory_points += piece.points
        if on_disk and not written:
            self._warn_once(
                "split",
                "gradwatch: spool file %s: could not write the pieces of a split batch; they wait in memory",
                self.path,
            )

    # -- internals --------------------------------------------------------------------------------

    def _index(self, entry: _Entry) -> None:
        if entry.order < 0:
            entry.order = entry.seq
        self._entries[entry.seq] = entry
        heapq.heappush(self._order, (entry.order, entry.seq))

    def _write(self, entries: list[_Entry], trailer: bytes = b"") -> bool:
        """Append entries (as many as the cap allows, oldest first), then `trailer` (record lines) if
        every entry fitted; True when all were written."""
        if self.path is None or self._disk_failed:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail_disk(exc)
            return False
        try:
            size = os.fstat(fd).st_size
            prefix = b""
            if not self._newline_checked:
                self._newline_checked = True
                if size and not self._ends_with_newline(self.path):
                    prefix = b"\n"  # a torn last line stays a (skipped) line of its own
            if not self._run_written:
                prefix += run_record(self.run_document, self.created_at)
            lines = []
            offset = size + len(prefix)
            total = len(prefix)
            for entry in entries:
                batch = entry.batch
                assert batch is not None, "an entry not yet in the file holds its batch"
                line = batch_record(self.run_id, batch, entry.points)
                if size + total + len(line) > self.max_bytes:
                    self._warn_once(
                        "cap",
                        "gradwatch: spool file %s reached its cap of %d MiB; unsent data now waits in memory "
                        "(up to %d points), beyond that it is dropped and counted in run.stats.dropped",
                        self.path,
                        self.max_bytes >> 20,
                        self.max_memory_points,
                    )
                    break
                lines.append((entry, batch, offset, line))
                offset += len(line)
                total += len(line)
            complete = len(lines) == len(entries)
            if not lines and not (complete and trailer):
                return False
            data = prefix + b"".join(line for _, _, _, line in lines) + (trailer if complete else b"")
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError as exc:
            self._fail_disk(exc)
            return False
        finally:
            os.close(fd)
        self._run_written = self._file_is_ours = True
        self._dirty = True
        self._hold_lock()
        for entry, batch, offset, line in lines:
            if entry.seq in self._entries:
                self.memory_points -= entry.points  # it moves from memory to the file
            self.disk_points += entry.points
            self._disk_entries += 1
            entry.record = Record(
                offset,
                len(line),
                "batch",
                self.run_id,
                int(batch["rank"]),
                entry.seq,
                entry.points,
            )
            entry.batch = None
        return complete

    def close(self) -> None:
        """The process is done with the file: what it wrote is made durable and the file left to
        `gradwatch sync` (or a resumed run)."""
        self.fsync()
        self._release_lock()

    def _hold_lock(self) -> None:
        """While this process writes or replays the file it holds a shared lock on it (flock), so that
        `gradwatch sync`, which asks for an exclusive one, leaves a file in use to the run that uses it
        (it sends its own batches) instead of racing it and deleting it under it."""
        if self._lock_fd is not None or self.path is None or fcntl is None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self._lock_fd = fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock

    @staticmethod
    def _ends_with_newline(path: Path) -> bool:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _fail_disk(self, exc: OSError) -> None:
        self._disk_failed = True
        self._warn_once(
            "disk",
            "gradwatch: cannot write the spool file %s (%s: %s); unsent data is kept in memory only "
            "(up to %d points), beyond that it is dropped and counted in run.stats.dropped",
            self.path,
            type(exc).__name__,
            exc,
            self.max_memory_points,
        )

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)


class DeadLetters:
    """The dead-letter file of one (run, rank): batches the server will not take, kept for
    `gradwatch sync` (same format as a spool file, each batch after a line saying why).
    Written rarely, so each write is fsynced at once. Not thread-safe: the sender holds its lock."""

    def __init__(
        self, path: Path, run_document: dict[str, Any], rank: int = 0, created_at: float | None = None
    ) -> None:
        """created_at: when the run started (Unix seconds; default now), written in the run record."""
        self.path = path
        self.run_document = run_document
        self.created_at = time.time() if created_at is None else created_at
        self.run_id = run_document["id"]
        self.rank = rank
        self.batches = 0  # moved here by this process
        self.points = 0
        self._run_written = False

    def add(self, seq: int, body: bytes, points: int, reason: str) -> bool:
        """Append one batch (its wire JSON) with the reason; False when the file cannot be written."""
        data = b""
        if not self._run_written:
            data += run_record(self.run_document, self.created_at)
        data += dead_letter_record(self.run_id, self.rank, seq, reason)
        data += encoded_batch_record(self.run_id, self.rank, seq, points, body)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size and not Spool._ends_with_newline(self.path):
                    data = b"\n" + data
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("gradwatch: cannot write the dead-letter file %s (%s)", self.path, exc)
            return False
        self._run_written = True
        self.batches += 1
        self.points += points
        return True
