"""Stopping a long-running loop on SIGTERM/SIGINT, one way for every command that runs one.

The first signal asks the loop to stop (it finishes what it is doing: the worker its
running jobs, the relay its batch); a second one exits the process at once.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable


def install_stop_signals(stop: Callable[[], None], name: str) -> dict | None:
    """Route SIGTERM and SIGINT to ``stop()`` (which must only set flags: it runs in a
    signal handler); a second signal prints ``<name>: second signal`` and exits 1. Only in
    the main thread; returns the previous handlers for :func:`restore_signals`, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    received = [0]

    def on_signal(signum, frame):
        received[0] += 1
        if received[0] > 1:
            os.write(2, f"{name}: second signal, exiting now\n".encode())
            os._exit(1)
        stop()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(old: dict | None) -> None:
    for sig, handler in (old or {}).items():
        signal.signal(sig, handler)
