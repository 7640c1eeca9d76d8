"""The data dir's two short waits (shardq/datadir.py): taking a lock file another process
holds, and waiting for a service that is starting. Both are timed by the Clock their caller
gives, so a clock that has run past the wait ends it after one look, with the typed error."""
from __future__ import annotations

import fcntl
import os

import pytest

from shardq.clock import FakeClock
from shardq.datadir import SUPERVISOR_LOCK, DataDir
from shardq.errors import DataDirLocked, ServiceNotRunning


class Ticking(FakeClock):
    """Each monotonic reading is a minute after the last: every deadline has passed when next read."""

    def monotonic(self) -> float:
        return self.advance(60.0)


def test_a_held_lock_is_refused_once_the_callers_clock_passes_the_wait(tmp_path):
    dd = DataDir(tmp_path)
    holder = os.open(tmp_path / "x.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: flock conflicts
        os.pwrite(holder, b"4242\n", 0)
        with pytest.raises(DataDirLocked, match="pid 4242"):
            dd.lock("x.lock", clock=Ticking())
    finally:
        os.close(holder)
    os.close(dd.lock("x.lock", clock=Ticking()))  # free again: taken at once


def test_no_service_is_reported_once_the_callers_clock_passes_the_grace(tmp_path):
    dd = DataDir(tmp_path)
    (tmp_path / SUPERVISOR_LOCK).write_text("")  # a service ran here once, none holds it now
    with pytest.raises(ServiceNotRunning):
        dd.require_service(grace_s=3600.0, clock=Ticking())
