"""The commands that only the local shards' service can do, given a backend's URL
(``--connect sqs://...``): one ``error: Unsupported: <command>: not supported by the
SqsQueue backend`` line, exit 2, the form ``queue pause`` has (``common.unsupported``), and
nothing read or made, rather than the URL taken as a directory's name (``console`` said
``ServiceNotRunning ... start shardq serve --data-dir .../sqs:/...``, ``backup``
``NotADataDir``, ``serve`` made that directory and served it, ``schedules`` listed from it).
No SQS server is needed: each is refused before anything connects."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardq.cli.main import main

from support.service import REPO

# a port nothing listens on: a command that tried to reach it would fail otherwise
TARGET = "sqs://us-east-1/try?endpoint=http://127.0.0.1:9"


def refused(call: str) -> list[str]:
    return [f"error: Unsupported: {call}: not supported by the SqsQueue backend"]


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """A working directory of its own, to see that nothing was made in it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, call", [
    (["console"], "console"),
    (["backup", "dest"], "backup"),
    (["restore", "a-backup"], "restore"),
    (["wal", "check"], "wal check"),
    (["schedules"], "schedules"),
    (["schedules", "--json"], "schedules"),
    (["job", "show", "abc"], "job"),     # an SQS message id is text: refused as the call, not as an id
    (["job", "cancel", "abc"], "cancel"),
    (["job", "12"], "job"),
    (["queue", "pause", "default"], "pause"),
])
def test_a_local_only_command_refuses_a_backend_url(capsys, empty_cwd, argv, call):
    assert main([*argv, "--connect", TARGET]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == refused(call)
    assert captured.out == ""
    assert os.listdir(empty_cwd) == []  # no "sqs:" directory, no backup dest


def test_the_configs_data_dir_is_refused_alike(capsys, empty_cwd):
    (empty_cwd / "shardq.toml").write_text(f'[service]\ndata_dir = "{TARGET}"\n')
    assert main(["backup", "dest", "--config", "shardq.toml"]) == 2
    assert capsys.readouterr().err.splitlines() == refused("backup")
    assert os.listdir(empty_cwd) == ["shardq.toml"]


def test_wal_check_of_a_path_still_reads_that_path(capsys, empty_cwd):
    """``wal check PATH`` does not use the target: PATH is checked, as before."""
    (empty_cwd / "shard").mkdir()
    assert main(["wal", "check", "shard", "--connect", TARGET]) == 2
    assert "neither a shardq data dir nor a shard directory" in capsys.readouterr().err


def test_serve_refuses_it_and_makes_no_data_dir(tmp_path):
    """A subprocess: ``serve`` made the URL's directory and served it until stopped (the
    timeout is the failure on the code before the fix)."""
    r = subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--connect", TARGET], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == refused("serve")
    assert os.listdir(tmp_path) == []


def test_a_local_job_id_that_is_not_one_is_still_the_argument_error(capsys, empty_cwd):
    """Unchanged on the local shards (argparse refused it before; the command does now)."""
    try:
        rc = main(["job", "show", "abc", "--data-dir", str(empty_cwd)])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: UsageError: argument job_id: not a job id: 'abc' (see shardq job --help)"]
