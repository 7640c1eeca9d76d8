"""An error whose text holds a lone surrogate (a file name that is not UTF-8, as
``os.fsdecode`` and ``os.listdir`` give it) in a task's traceback: only the first line of the
error text was made text the wire takes, the traceback appended as it was, so the bury was
refused ("surrogates not allowed"), the job ran again at each lease's end and was
dead-lettered as "lease expired after N deliveries", its own error lost."""
from __future__ import annotations

import logging
import os

import pytest

import shardq
from shardq import limits
from shardq.consumer.handling import with_traceback

NAME = os.fsdecode(b"/data/caf\xe9.csv")     # '/data/caf\udce9.csv'


def _raise(depth: int) -> None:
    """``depth`` errors, each naming the file, chained under the last (a long traceback)."""
    if depth:
        try:
            _raise(depth - 1)
        except ValueError as exc:
            raise ValueError(f"cannot parse {NAME}") from exc
    raise ValueError(f"cannot parse {NAME}")


def _error(depth: int = 0) -> ValueError:
    try:
        _raise(depth)
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize("depth", [0, 100])          # the whole traceback; its innermost frames
def test_the_whole_error_text_with_its_traceback_is_utf8(depth):
    exc = _error(depth)
    out = with_traceback(f"ValueError: cannot parse {NAME} (attempt 1; retries=0 used up)", exc)
    raw = out.encode("utf-8")                       # strict: no lone surrogate left
    assert len(raw) <= limits.ERROR_TEXT_BYTES_MAX
    assert out.splitlines()[0] == "ValueError: cannot parse /data/caf?.csv (attempt 1; retries=0 used up)"
    assert out.endswith("\nValueError: cannot parse /data/caf?.csv")   # the traceback's last line
    assert ("Traceback (innermost frames; the rest cut):" in out) == (depth > 0)
    assert out.count("caf?.csv") >= (2 if depth == 0 else 4)


@pytest.fixture
def app():
    a = shardq.App.embedded(config={"queue_defaults": {"visibility_timeout": 30, "max_deliveries": 3}})
    yield a
    a.close()


def test_a_task_error_naming_an_undecodable_file_is_buried_at_once_with_its_error(app, monkeypatch):
    # The worker's log line has the exception's own traceback, surrogate and all (a stream
    # handler writes it as \udce9): pytest-xdist cannot send such a captured log back.
    monkeypatch.setattr(logging.getLogger("shardq.worker"), "disabled", True)
    runs: list[int] = []

    @app.task(queue="t-surrogate", retries=0, name="ingest")
    def ingest(ctx, path: bytes) -> None:
        runs.append(ctx.attempt)
        raise ValueError(f"cannot parse {os.fsdecode(path)}")

    job = ingest.send(b"/data/caf\xe9.csv")
    app.run_worker("t-surrogate", idle_wait_s=0.05, poll_s=0.01)   # burst: returns once settled
    status = app.status(job)
    assert status["state"] == "dead", status
    assert runs == [1]
    first, rest = status["error"].split("\n", 1)
    assert first == "ValueError: cannot parse /data/caf?.csv (attempt 1; retries=0 used up)"
    assert rest.startswith("Traceback") and rest.endswith("ValueError: cannot parse /data/caf?.csv")
    [dead] = app.queue.dead_letters("t-surrogate")
    assert dead.job_id == job and dead.attempts == 1 and dead.error == status["error"]
