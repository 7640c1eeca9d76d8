"""Stopping a long-running loop on SIGTERM/SIGINT, one way for every command that runs one.

The first signal asks the loop to stop (it finishes what it is doing: the worker its
running jobs, the relay its batch); a second one exits the process at once.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

#: the handlers a signal had before: what :func:`restore_signals` puts back
Handlers = dict[signal.Signals, Any]


def install_stop_signals(stop: Callable[[], None], name: str) -> Handlers | None:
    """Route SIGTERM, SIGINT and SIGHUP to ``stop()`` (which must only set flags: it runs in
    a signal handler); a second signal prints ``<name>: second signal`` and exits 1. SIGHUP
    (the terminal or ssh session closed) is a clean stop too: by default it killed the
    process without a word, its jobs held until their leases ran out. Only in the main
    thread; returns the previous handlers for :func:`restore_signals`, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    received = [0]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received[0] += 1
        if received[0] > 1:
            os.write(2, f"{name}: second signal, exiting now\n".encode())
            os._exit(1)
        stop()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}


class StopBeforeStart(BaseException):
    """A stop signal came while a command was still starting, before its loop took the
    signals over. A BaseException, so that no ``except Exception`` on the way (a connect
    retry, a handler's import) swallows it."""


def stop_while_starting() -> Handlers | None:
    """Make SIGTERM/SIGINT, until a loop installs its own handlers, a clean stop of a command
    that is still starting (importing the handler, connecting, opening its store): the
    handler raises :class:`StopBeforeStart`, which the command turns into exit 0, as it
    would a stop once running. Without it a service manager's SIGTERM in those first
    moments kills the process by the signal. Only in the main thread; returns the previous
    handlers for :func:`restore_signals`, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise StopBeforeStart(signal.Signals(signum).name)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}


def restore_signals(old: Handlers | None) -> None:
    for sig, handler in (old or {}).items():
        signal.signal(sig, handler)


def exit_with_parent(parent_pid: int, every_s: float = 0.5) -> None:
    """End this process once ``parent_pid`` is no longer its parent (it died, even by
    SIGKILL, and the process was handed to init): a daemon thread looks every ``every_s``.
    For pool processes, which would otherwise wait for work for ever. A job one was running
    is not committed (its transaction is never finished): its lease runs out and it comes
    back, as with any worker that dies."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)  # polling the parent: no event tells a process its parent died
        os._exit(0)
    threading.Thread(target=watch, name="shardq-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the supervisor, ``serve``) dies, so
    no orphan keeps writing a log or answering on a port; exit at once (status 0) if the
    parent is already gone, having died before the signal was armed."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)
