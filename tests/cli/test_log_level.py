"""``--log-level``: one argparse type for every command that takes it (``worker``, ``outbox
relay``, and ``shardq.cli.worker.main``). A level that is not one is a wrong command line:
one ``error: UsageError`` line naming the levels, exit 2, never ``setLevel``'s ValueError
traceback (each case failed so on the code before the fix). No service is needed: the
command line is refused before anything connects."""
from __future__ import annotations

import logging

import pytest

from shardq.cli import common, worker
from shardq.cli.main import main

LEVELS = "one of DEBUG, INFO, WARNING, ERROR, CRITICAL; any case"


@pytest.mark.parametrize("argv, prog", [
    (["worker", "myapp.jobs:handle"], "shardq worker"),
    (["outbox", "relay", "--dsn", "postgresql:///x"], "shardq outbox relay")])
def test_a_bad_level_is_a_usage_error_naming_the_levels(capsys, argv, prog):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--log-level", "bogus"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error: UsageError: argument --log-level: not a log level: 'bogus' ({LEVELS}) (see {prog} --help)"]
    assert captured.out == ""


def test_the_worker_entry_point_refuses_it_alike(capsys):
    with pytest.raises(SystemExit) as e:
        worker.main(["myapp.jobs:handle", "--log-level", "Bogus"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: UsageError: argument --log-level: not a log level: 'Bogus' ({LEVELS}) (see shardq worker --help)"]


@pytest.mark.parametrize("text, level", [("debug", "DEBUG"), ("Info", "INFO"), ("WARNING", "WARNING"),
                                         ("error", "ERROR"), ("critical", "CRITICAL"), ("warn", "WARN")])
def test_a_level_is_taken_in_any_case_as_logging_names_it(text, level):
    assert common.log_level(text) == level
    logging.getLogger("shardq.test-log-level").setLevel(level)  # what the commands do with it


def test_the_flag_is_the_same_wherever_it_is_taken():
    from shardq.cli.main import build_parser
    parser = build_parser()
    for argv in (["worker", "m:f"], ["outbox", "relay", "--dsn", "x"]):
        assert parser.parse_args(argv).log_level == "INFO"
        assert parser.parse_args([*argv, "--log-level", "warning"]).log_level == "WARNING"
