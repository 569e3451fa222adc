"""A Run: one training job's connection to gradwatch (its id, step counter, buffer and sender)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from . import _distributed, _resume
from ._batches import BatchLog, normalize_ids
from ._buffer import StepBuffer
from ._distributed import ProcessIdentity, process_identity
from ._errors import FeatureSwitch, GradwatchWarning, crash_details
from ._guard import Guard
from ._guard_offline import OfflineVerdicts
from ._run_exit import _finish_live_runs, _live_runs, _track
from ._run_finish import report_finish
from ._run_metadata import _environment_metadata
from ._run_sink import _RunSink
from ._sender import DEFAULT_STALL_TIMEOUT, Sender
from ._spool import DEFAULT_MAX_BYTES, Spool, default_spool_dir, offline_dir, spool_file_name
from ._transport import Backoff, HttpTransport, Transport
from ._wire import json_safe, key_problem

if TYPE_CHECKING:
    from ._watch import Watcher

# _finish_live_runs too: it lives in _run_exit, and the tests call it as _run's (what SIGTERM does)
__all__ = [
    "DEFAULT_SERVER",
    "FLUSH_AT_VALUES",
    "MODES",
    "RUN_ID_PATTERN",
    "Run",
    "_finish_live_runs",
    "server_and_token",
]

logger = logging.getLogger("gradwatch")

DEFAULT_SERVER = "http://127.0.0.1:8765"


def server_and_token(server: str | None = None, token: str | None = None) -> tuple[str, str | None]:
    """The server URL and token when not given: GRADWATCH_SERVER (else DEFAULT_SERVER) and
    GRADWATCH_TOKEN; the one rule of init(), gradwatch.Api and `gradwatch sync`."""
    return (
        server or os.environ.get("GRADWATCH_SERVER") or DEFAULT_SERVER,
        token or os.environ.get("GRADWATCH_TOKEN") or None,
    )


MODES = ("online", "offline")
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # the server's rule for run ids
# run.log() flushes once it has taken this many values since the last flush, whatever the clock and
# the step counter say (a loop logging with step= and no optimizer step would otherwise buffer a
# whole second: a million points in one packet, sent after it was all resolved). The sender merges
# such flushes into batches of up to max_batch_points.
FLUSH_AT_VALUES = 10_000


class Run:
    """Records one training run. Create with gradwatch.init(); use as a context manager or call finish().

    Steps: the first optimizer step is step 0; each optimizer step (skipped or not) advances the
    counter by one; log() without step= attaches to the current counter value.
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        *,
        server: str = DEFAULT_SERVER,
        token: str | None = None,
        config: dict[str, Any] | None = None,
        tags: list[str] | tuple[str, ...] | None = None,
        mode: str = "online",
        run_id: str | None = None,
        resume: str | None = None,
        rank: int | None = None,
        transport: Transport | None = None,
        flush_interval: float = 1.0,
        flush_every_steps: int = 100,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = DEFAULT_MAX_BYTES,
        max_backoff: float = 30.0,
    ) -> None:
        """spool_dir: where unsent batches wait on disk (default GRADWATCH_SPOOL_DIR, else
        GRADWATCH_HOME/spool; with your own transport= and no spool_dir they wait in memory only);
        spool_max_bytes: the spool file's cap; max_backoff: longest wait between retries (seconds).
        Offline mode writes GRADWATCH_HOME/offline/RUN-rankR.jsonl for `gradwatch sync`.
        rank: this process's rank in a distributed job (default: see gradwatch.init).
        tags: labels to filter runs by (e.g. ["baseline", "lora-r16"]; 1-100 characters each).
        resume: "allow" | "must" | "never" continues run `run_id` from a checkpoint (see _resume:
        init() raises ResumeError only on the server's definite answer against the mode)."""
        if not project or not isinstance(project, str):
            raise ValueError(f"project must be a non-empty string, got {project!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be positive (seconds), got {flush_interval!r}")
        tags = list(tags or ())
        if any(not isinstance(tag, str) or not 1 <= len(tag) <= 100 for tag in tags) or len(tags) > 50:
            raise ValueError(f"tags must be at most 50 strings of 1-100 characters, got {tags!r}")
        if run_id is not None and not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"run_id must be 1-64 characters of A-Z a-z 0-9 _ . -, got {run_id!r}")
        resume = _resume.validate(resume)
        identity = process_identity()
        rank_given = rank is not None
        if rank is None:
            rank = identity.rank
        elif not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be a whole number >= 0, got {rank!r}")
        else:
            identity = dataclasses.replace(identity, rank=rank, world_size=max(identity.world_size, rank + 1))
        # One job, one run (see _distributed): an id every rank derives alike, else rank 0's once
        # torch.distributed is up; a rank that cannot know yet is on hold until watch() or finish().
        self._occurrence = _distributed.next_occurrence(project, name)
        self._id_key = _distributed.next_run_id_key(project)
        self._name_argument = name
        self._name_given = bool(name)
        self._rank_given = rank_given
        shared = run_id or _distributed.shared_run_id(project, name, occurrence=self._occurrence)
        self._id_settled = shared is not None  # the job's id, whatever rank 0 says
        self.id = shared or uuid.uuid4().hex
        self.rank = rank
        self._held = False
        if _distributed.is_initialised():
            self._agree_on_id()
        elif _distributed.may_become_distributed():
            self._held = not self._id_settled or (identity.source == "default" and not rank_given)
        self.project = project
        self.name = name or self.id[:8]
        self.identity = identity
        # A distributed run's ranks announce themselves ("rank" events: at watch() and at the end).
        self.reports_rank = identity.world_size > 1
        self.mode = mode
        self._step = 0  # run.step: a property (a resumed run learns its step from it)
        self._resume: _resume.PendingResume | None = None
        self.features = FeatureSwitch()
        # Guarded once here, not per call: log() and the flush check run on every step.
        self._guarded_log = self.features.guarded("log")(self._log)
        self._guarded_flush = self.features.guarded("flush")(self._flush)
        self._guarded_log_batch = self.features.guarded("log_batch")(self._log_batch)
        self.buffer = StepBuffer()
        self._batches = BatchLog()
        self.flush_interval = flush_interval
        self.flush_every_steps = flush_every_steps
        self._last_flush_time = time.monotonic()
        self._last_flush_step = 0
        self._logged_since_flush = 0  # values run.log took since the last flush (see FLUSH_AT_VALUES)
        self._watchers: list[Watcher] = []
        self.guard: Guard | None = None  # watch(guard=...): acts on incidents (gradwatch._guard)
        self._refused_keys: set[str] = set()  # keys log() left out (warned once each)
        self._accepted_keys: set[str] = set()  # keys checked once and found fine
        self._finished = False
        if mode == "offline" and transport is not None:
            raise ValueError("mode='offline' writes the spool file only; it takes no transport=")
        self.server = server
        document = {
            "id": self.id,
            "project": project,
            "name": self.name,
            "tags": tags,
            "config": json_safe(config or {}),
            "metadata": json_safe(_environment_metadata(identity)),
        }
        if mode == "offline":
            spool_path: Path | None = Path(spool_dir or offline_dir()) / spool_file_name(self.id, rank)
        elif transport is None or spool_dir is not None:
            spool_path = Path(spool_dir or default_spool_dir()) / spool_file_name(self.id, rank)
        else:
            spool_path = None
        if transport is None and mode == "online":
            transport = HttpTransport(server, token)
        # Before anything starts: the server's definite "no such run" (resume="must") raises here.
        id_known = getattr(self, "_id_settled", run_id is not None)
        self._resume = _resume.begin(resume, mode, transport, document, id_known, rank)
        if self._resume is not None:
            self._step = self._last_flush_step = self._resume.start
        spool = Spool(spool_path, document, rank, max_bytes=spool_max_bytes, keep_file=mode == "offline")
        backoff = Backoff(base=min(0.25, max_backoff), cap=max_backoff)
        self._sender = Sender(transport, document, rank, spool, backoff=backoff, hold=self._held)
        self._sender.on_renamed = self._renamed_by_server
        _track(self)

    # -- public API -------------------------------------------------------------------------------

    def watch(
        self, model: Any, optimizer: Any, scaler: Any = None, *, guard: Any = None, **options: Any
    ) -> Run:
        """Observe `optimizer`'s steps (and `scaler`'s loss scale) for the parameters of `model`.

        guard (off by default): a gradwatch.Guard, True for its defaults, or a callable taking each new
        incident; it acts on the run's incidents in the training thread at a step boundary: the callback,
        `run.should_stop` (critical incidents by default), optionally TrainingHalted from run.log().

        options (see WatchOptions): layer_norms_every=20, histograms_every=100, update_ratio_every=100
        param_norms_every=100 (optimizer steps; 0 = off), samples_per_step / tokens_per_step for throughput,
        histogram_ranks="auto" (distributed: rank 0 alone for replicated gradients, every rank for
        sharded ones; "all"; or a collection of ranks), dense_start_steps=200 (during the first N
        steps the sampled quantities are also taken every max(1, every // 5) steps; 0 = off).
        """
        from ._watch import Watcher, WatchOptions  # only when watching: keeps `import gradwatch` light

        watch_options = WatchOptions(**options)
        if self._watchers:
            raise ValueError("this run already watches a model and optimizer; use one run per optimizer")

        if not hasattr(optimizer, "param_groups"):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(model, "named_parameters"):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if scaler is not None and not hasattr(scaler, "is_enabled"):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.guard = Guard.from_argument(guard)
        if self.guard is not None:
            self._sender.remote.ask_for_incidents(self.guard.receive)
            if self.mode == "offline":  # no server to judge the run: the agent judges what it can
                self.guard.offline = OfflineVerdicts()
        self._settle_id(agree=True)  # before the Watcher: it takes the rank
        self._watchers.append(Watcher(_RunSink(self), model, optimizer, scaler, watch_options))
        return self

    @property
    def should_stop(self) -> bool:
        """True once the guard (watch(guard=...)) stopped training on an incident: `if run.should_stop:
        save(); break`. Always False without a guard. Every rank of a distributed job sees it at the
        same step."""
        return self.guard is not None and self.guard.should_stop

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        """Record scalars (numbers or one-element tensors, kept on their device) at `step`. With
        Guard(raise_on_stop=True), raises gradwatch.TrainingHalted once the guard stopped training."""
        self._guarded_log(data, step)
        if self.guard is not None:
            if self.guard.offline is not None and isinstance(data, dict) and "loss" in data:
                self.guard.offline.note_loss(data["loss"])
            self.guard.halt_if_asked()

    def log_batch(self, ids: Any, step: int | None = None) -> None:
        """Remember which samples the step trained on: an int, a str, or a sequence of ints/strs
        (sample indices, file names, "shard:offset"…), or an integer tensor on the CPU.

        Kept on the host only, for the last 1024 steps, at most 64 ids per step (a step logged
        several times, e.g. once per micro-batch, keeps the first 64) and 200 characters per string;
        nothing is sent per step. When the step's `loss` (run.log) or `amp/loss` (the losses passed
        to scaler.scale) is NaN or infinite, a `bad_batch` event at that step names them (at most
        100 such events per run). Without step= the ids attach to the current step, as log() does.
        Bad ids are ignored with a GradwatchWarning.
        """
        self._guarded_log_batch(ids, step)

    def finish(
        self,
        timeout: float | None = None,
        status: str = "finished",
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        """Flush, send what is queued, and close. Safe to call twice.

        It waits as long as the server makes progress: it returns once the server has stored
        everything, or once the server has taken nothing for `stall_timeout` seconds (default 30:
        it is down, refuses the token, or fails every batch), or after `timeout` seconds in all if
        you give one (default: no cap). While a large backlog uploads, a progress line goes to
        stderr every few seconds ("gradwatch: run R: uploading 457,668 points, 63%"); a quick
        finish prints nothing. What the server has not taken then stays in the spool file, named
        in a warning with the reason; a run resumed with the same id and rank sends it, or
        `gradwatch sync FILE` does. Batches the server would not take at all are in the dead-letter
        file beside it (run.stats.dead_lettered), which `gradwatch sync` retries. At exit or on
        SIGTERM an unfinished run is finished with timeout=5.
        """
        if self._finished:
            return
        self._finished = True
        self._settle_id(agree=False)
        _live_runs.discard(self)
        for watcher in self._watchers:
            watcher.remove()
        if self.reports_rank:  # how this rank ended: a crashed rank stands out in the run's rank list
            self.buffer.add_event(max(self.step - 1, 0), "rank", {"rank": self.rank, "status": status})
        self.features.guarded("flush")(self._flush)(status)
        sender = self._sender
        everything_sent = sender.close(timeout, stall_timeout)
        report_finish(self.id, self.mode, sender, everything_sent, timeout, stall_timeout)

    @property
    def stats(self) -> Any:
        """The agent's own health (SenderStats), in points: queued, sent, spooled, dropped,
        dead_lettered (and dead_lettered_batches), and last_error. Each batch also carries them as
        agent/queued, agent/sent, agent/spooled, agent/dropped (and, once any, agent/dead_lettered)
        at its last step."""
        return self._sender.stats

    @property
    def url(self) -> str:
        """The run's dashboard page (with its project: two projects may each have a run of this id)."""
        return f"{self.server.rstrip('/')}/dashboard/runs/{self.id}?project={quote(self.project, safe='')}"

    @property
    def step(self) -> int:
        """The current optimizer step: what is recorded now belongs to it (the first step is 0)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        """Set the step counter, e.g. from a checkpoint after gradwatch.init(resume=...): the resumed
        run continues at this step (see _resume), what was recorded since init() moving with it."""
        if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < 0:
            raise ValueError(f"run.step must be a whole number >= 0, got {value!r}")
        if self._resume is not None:
            self._resumed_at(value.__index__(), "run.step")
        else:
            self._step = value.__index__()

    def __enter__(self) -> Run:  # noqa: PYI034 -- Run is not meant to be subclassed
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        clean = exc_type is None or (isinstance(exc, SystemExit) and exc.code in (0, None))
        if not clean:
            self._record_crash(crash_details(exc if isinstance(exc, BaseException) else None))
        self.finish(status="finished" if clean else "crashed")

    # -- internals --------------------------------------------------------------------------------

    def _agree_on_id(self) -> bool:
        """(torch.distributed initialised; at init() or watch(), never in the step) Leave this run's
        id for the other ranks (rank 0) or take rank 0's (the others, unless the id is settled).
        True when this rank now has the job's id; a failure is a warning, and the id stays."""
        try:
            agreed = _distributed.agree_on_run_id(self.id, self._id_key, follow=not self._id_settled)
        except Exception as exc:  # noqa: BLE001 - a store that fails must not stop training
            warnings.warn(
                f"gradwatch: rank {self.rank} could not learn rank 0's run id ({type(exc).__name__}: "
                f"{exc}), so it records a run of its own. Set GRADWATCH_RUN_ID to one value on "
                "every rank (or pass run_id=) to make sure the ranks share one run",
                GradwatchWarning,
                stacklevel=4,
            )
            return False
        if agreed is None:
            return False
        self.id = agreed
        return True

    def _settle_id(self, agree: bool) -> None:
        """At watch() (agree: hear from rank 0) or finish(): settle a run on hold -- its rank from
        torch.distributed once initialised, its id rank 0's, else the launcher's (see _distributed)
        -- and let the sender start. A rank 0 not on hold leaves its id for ranks that are."""
        if not self._held:
            if agree and self.rank == 0 and _distributed.is_initialised():
                self._agree_on_id()  # rank 0 never waits; a rank on hold may be waiting for this
            return
        self._held = False
        run_id, rank, identity = self.id, self.rank, self.identity
        try:
            fresh = process_identity()
            if fresh.source == "torch.distributed" and not self._rank_given:
                rank, identity = fresh.rank, fresh
            self.rank = rank
            asked = agree and fresh.source == "torch.distributed"
            agreed = asked and self._agree_on_id()  # a failure has been warned about
            run_id = self.id
            if not agreed and not self._id_settled and identity.world_size > 1:
                run_id, source = _distributed.launcher_run_id(
                    self.project, self._name_argument, self._occurrence
                )
                if source == "host" and not asked:
                    warnings.warn(
                        f"gradwatch: rank {rank} of {identity.world_size} settled its run id without "
                        "hearing from rank 0 (torch.distributed was not initialised): the ranks this "
                        f"host's launcher started share run {run_id}, ranks on other hosts do not. Call "
                        "run.watch() after init_process_group(), or set GRADWATCH_RUN_ID to one value on "
                        "every rank (or pass run_id=)",
                        GradwatchWarning,
                        stacklevel=3,
                    )
        except Exception as exc:  # settling must not stop training
            logger.warning("gradwatch: could not settle run %s's id: %s", self.id, exc, exc_info=exc)
        try:
            self._adopt_identity(run_id, rank, identity)
        finally:
            self._sender.release()  # a no-op once released

    def _adopt_identity(self, run_id: str, rank: int, identity: ProcessIdentity) -> None:
        """Take the settled id and rank, in the run document too, and start the sender under them."""
        sender = self._sender
        renamed = run_id != sender.run_id or rank != sender.rank
        self.id, self.rank, self.identity = run_id, rank, identity
        if not self._name_given:
            self.name = run_id[:8]
        self.reports_rank = self.reports_rank or identity.world_size > 1
        document = sender.run_document
        document["id"], document["name"] = run_id, self.name
        metadata = document.get("metadata")
        if isinstance(metadata, dict):
            metadata.update(rank=rank, world_size=identity.world_size, local_rank=identity.local_rank)
            metadata["hostname"] = identity.host
        path = sender.spool.path
        new_path = path.with_name(spool_file_name(run_id, rank)) if path is not None and renamed else None
        sender.release(run_id, rank, new_path)

    def _log(self, data: object, step: int | None) -> None:  # data: what the caller passed to log()
        if not isinstance(data, dict):
            warnings.warn(
                f"gradwatch: log() takes a dict, got {type(data).__name__}", GradwatchWarning, stacklevel=3
            )
            return
        if step is not None and self._resume is not None:
            # The first log(step=N) of a resumed run says where it is: before its first optimizer step
            # N is the current step, after it the step that just ended.
            ended = self._step - self._resume.start
            self._resumed_at(int(step) + (1 if ended else 0), "run.log(step=)")
        at = self.step if step is None else int(step)
        columns = self.buffer.host_columns
        for key, value in data.items():
            kind = type(value)
            if (kind is float or kind is int) and type(key) is str:  # the usual case, kept cheap
                column = columns.get(key)
                if column is None:
                    if not self._key_accepted(key):
                        continue
                    column = columns[key] = ([], [])
                column[0].append(at)
                column[1].append(float(value))
                continue
            if not self._key_accepted(str(key)):
                continue
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) or getattr(value, "numel", lambda: 0)() == 1
            ):
                warnings.warn(
                    f"gradwatch: log() ignored {key!r}: expected a number or a one-element tensor, "
                    f"got {type(value).__name__}",
                    GradwatchWarning,
                    stacklevel=3,
                )
                continue
            self.buffer.add_scalar(str(key), at, value)
        self._logged_since_flush += len(data)
        if not any(watcher.step_open for watcher in self._watchers):
            # Mid-step (a log between backward and the optimizer step) the flush waits for the step's
            # end: a packet holds whole steps, so what is derived from several keys of one step (a
            # skip's scales, the clip threshold) is derived from all of them.
            self._maybe_flush()

    def _renamed_by_server(self, run_id: str) -> None:
        """(sender thread) Another project had this run's id: the server stores it under `run_id`,
        which run.id and run.url name from now on."""
        self.id = run_id

    def _key_accepted(self, key: str) -> bool:
        """Whether the server can store `key` (checked when a key first enters the buffer). One bad
        key would have the server refuse its whole batch, and the valid points with it: it is left
        out instead, with one warning per key."""
        if key in self._accepted_keys:
            return True
        problem = key_problem(key)
        if problem is None:
            self._accepted_keys.add(key)
            return True
        if key not in self._refused_keys:
            self._refused_keys.add(key)
            warnings.warn(
                f"gradwatch: log() left out the key {key[:60]!r}{'…' if len(key) > 60 else ''}: {problem}",
                GradwatchWarning,
                stacklevel=4,
            )
        return False

    def _log_batch(self, ids: Any, step: int | None) -> None:
        try:
            normalized = normalize_ids(ids)
        except (TypeError, ValueError) as exc:
            warnings.warn(f"gradwatch: log_batch() ignored its ids: {exc}", GradwatchWarning, stacklevel=3)
            return
        self._batches.add(self.step if step is None else int(step), normalized)

    def _resumed_at(self, current: int, source: str) -> None:
        """A resumed run learns its step: `current` is the current step in the resumed numbering.
        Everything recorded since init() is renumbered, and the `resume` event goes out at the step the
        run resumed from (so the server replaces the earlier attempt's data from there on)."""
        pending, self._resume = self._resume, None
        if pending is None:
            return
        delta = current - self._step
        resumed_from = pending.start + delta
        if resumed_from < 0:  # log(step=) below the steps already taken: keep the counter as it is
            delta, resumed_from = 0, pending.start
        self.buffer.shift_steps(delta)
        self._batches.shift_steps(delta)
        for watcher in self._watchers:
            watcher.shift_steps(delta)
        self._step += delta
        self._last_flush_step += delta
        self.buffer.add_event(resumed_from, _resume.RESUME_EVENT, _resume.resume_data(pending, source))
        if source == "start" and not pending.known:
            _resume.warn_unknown_step(self.id)

    def _record_crash(self, details: dict[str, Any]) -> None:
        """A `crash` event at the last step: what ended the run (the server shows it as the reason)."""
        try:
            self.buffer.add_event(max(self._step - 1, 0), "crash", json_safe(details))
        except Exception:  # on the way out: the status still goes
            logger.debug("gradwatch: could not record the crash of run %s", self.id, exc_info=True)

    def _maybe_flush(self) -> None:
        pending = self._resume
        if pending is not None:  # a resumed run holds its data until it knows its step (bounded)
            steps = self._step - pending.start
            if steps < _resume.RESUME_GRACE_STEPS and len(self.buffer) < _resume.RESUME_HOLD_MAX_ITEMS:
                return
            self._resumed_at(self._step, "server" if pending.known else "start")
        due_by_time = time.monotonic() - self._last_flush_time >= self.flush_interval
        if (
            due_by_time
            or self.step - self._last_flush_step >= self.flush_every_steps
            or self._logged_since_flush >= FLUSH_AT_VALUES
        ):
            self._guarded_flush(None)

    def _record_device_memory(self) -> None:
        """Peak device memory (bytes) once per flush: an allocator counter, no device sync."""
        torch = sys.modules.get("torch")
        if torch is not None and self._watchers and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.buffer.add_scalar(
                "sys/max_memory_allocated", self.step, float(torch.cuda.max_memory_allocated())
            )

    def _flush(self, status: str | None) -> None:
        if self._resume is not None:  # finishing before the step was known: it is what it is now
            self._resumed_at(self._step, "server" if self._resume.known else "start")
        self._last_flush_time = time.monotonic()
        self._last_flush_step = self.step
        self._logged_since_flush = 0
        if not len(self.buffer) and status is None:
            return
        self._record_device_memory()
        packet = self.buffer.take([*(w.derive for w in self._watchers), self._batches.derive], status)
        self._sender.submit(packet)
