"""A Run's process life: the hooks that finish every unfinished run at exit, on SIGTERM and at the end
of a multiprocessing child (crashed when an uncaught exception ends the program), and make a forked
child's runs inert. Kept apart from _run because it is process-wide state (the live runs, the
installed hooks) rather than one run's; a Run registers itself here with _track() and leaves at
finish()."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from ._buffer import StepBuffer
from ._errors import crash_details

if TYPE_CHECKING:
    from ._run import Run

logger = logging.getLogger("gradwatch")

# -- process life: exit, SIGTERM, fork ---------------------------------------------------------------

EXIT_FLUSH_TIMEOUT = 5.0  # seconds each unfinished run gets at exit or SIGTERM; the rest is spooled
_live_runs: set[Run] = set()  # runs not finished yet (strong references: their threads are alive)
_hooks_lock = threading.Lock()
_exit_hooks_installed = False
_previous_sigterm: Any = None
_child_hook_pid: int | None = None  # the multiprocessing child that registered its exit hook


def _track(run: Run) -> None:
    """Remember an unfinished run and install the process hooks once (SIGTERM: from the main thread)."""
    global _exit_hooks_installed, _previous_sigterm, _child_hook_pid
    _live_runs.add(run)
    with _hooks_lock:
        if not _exit_hooks_installed:
            _exit_hooks_installed = True
            atexit.register(_finish_live_runs, None)
            if hasattr(os, "register_at_fork"):  # POSIX only
                os.register_at_fork(after_in_child=_after_fork_in_child)
        mp = sys.modules.get("multiprocessing")
        if _child_hook_pid != os.getpid() and mp is not None and mp.parent_process() is not None:
            # A multiprocessing child (mp.spawn, Accelerate's notebook_launcher, a DataLoader-style
            # worker) ends with os._exit: atexit never runs there, but multiprocessing's own exit
            # hook runs its finalizers, even when the child's target raised.
            import multiprocessing.util

            _child_hook_pid = os.getpid()
            multiprocessing.util.Finalize(None, _finish_in_multiprocessing_child, exitpriority=100)
        if _previous_sigterm is None and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous is not None:  # None: a handler set outside Python, which we could not call on
                _previous_sigterm = previous
                signal.signal(signal.SIGTERM, _on_sigterm)


def _finish_in_multiprocessing_child() -> None:
    """multiprocessing's exit hook in a child: it runs in the `finally` around the child's target, so
    an exception that ends the target is still in flight here (SystemExit(0): a normal end)."""
    exc = sys.exc_info()[1]
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        _finish_live_runs("finished")
    else:
        _finish_live_runs("crashed", crash_details(exc))


def _finish_live_runs(status: str | None, crash: dict[str, Any] | None = None) -> None:
    """Finish every unfinished run; at exit, "crashed" when an uncaught exception ends the program
    (its type and message go in a `crash` event: the run's status reason on the server)."""
    if status is None:
        uncaught = getattr(sys, "last_value", None)
        status = "crashed" if uncaught is not None else "finished"
        if isinstance(uncaught, SystemExit) and uncaught.code in (0, None):
            status = "finished"
        elif isinstance(uncaught, BaseException):
            crash = crash_details(uncaught)
    for run in list(_live_runs):
        try:
            if status == "crashed" and crash:
                run._record_crash(crash)
            run.finish(timeout=EXIT_FLUSH_TIMEOUT, status=status)
        except Exception:  # at exit, one run's failure must not stop the others
            logger.warning("gradwatch: could not finish run %s at exit", run.id, exc_info=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Flush every run, then do what the previous SIGTERM handler would have done."""
    _finish_live_runs("crashed", {"signal": "SIGTERM"})
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: terminate by this signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class _AllFeatures(dict[str, str]):
    """A FeatureSwitch.disabled that contains every feature: a forked child's run observes nothing."""

    def __contains__(self, feature: object) -> bool:
        return True


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) has none of the sender's threads and may hold copies
    # of its locks in a locked state; it also shares the parent's seq namespace, so anything it sent
    # could take the seq of a parent batch. Its runs therefore become inert.
    for run in list(_live_runs):
        run._sender.forget_after_fork()
        run.features.disabled = _AllFeatures(forked="this process is a fork of the one that started the run")
        run.buffer = StepBuffer()
        run._finished = True
    _live_runs.clear()
