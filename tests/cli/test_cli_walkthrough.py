"""What an operator's walkthrough of the ``shardq`` command found (each case failed on the
code before the fix): ``dead-letters list --limit`` out of range exited 0 when no queue held
dead letters; a job id the command cannot read said ``invalid _ref value`` from ack and
another error from each command; a queue name with control characters reached the
terminal raw; ``shardq console`` printed a login URL with a token serve refuses. One service
for the module; the command runs in this process where it only needs the service, as a
subprocess where the claim is about its environment (console)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardq.cli.main import main as shardq_main

from support.service import REPO, Service, short_tmpdir

ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
#: a queue name that, printed raw, sets the terminal's title, clears the screen and fakes a row
EVIL = "evil\x1b]0;pwned\x07\x1b[2J\nfake          9          9"
EVIL_SHOWN = "evil\\x1b]0;pwned\\x07\\x1b[2J\\nfake          9          9"  # as repr writes it


@pytest.fixture(scope="module")
def svc():
    # one delivery: a nack dead-letters the job (the control-character queue's dead letters)
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 1}, "queues": {"default": {}}}) as s:
        with s.connect() as s.q:
            yield s


def shardq(capsys, *args: str, svc=None) -> tuple[int, str, str]:
    """``shardq ARGS [--data-dir D]`` in this process: (exit code, stdout, stderr)."""
    argv = [*args, *(["--data-dir", svc.data_dir] if svc is not None else [])]
    try:
        rc = shardq_main(argv)
    except SystemExit as e:  # argparse: a usage error
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, "\n".join(l for l in err.splitlines() if l.startswith(("error:", "note:", "more:")))


# ---------------------------------------------------------------------------- --limit
@pytest.mark.parametrize("limit", ["0", "-1", "99999999999", "1001"])
def test_dead_letters_list_refuses_a_limit_out_of_range_with_no_dead_letters_anywhere(capsys, svc, limit):
    assert svc.q.stats()["queues"].get("default", {}).get("dead", 0) == 0
    rc, out, err = shardq(capsys, "dead-letters", "list", "--limit", limit, svc=svc)
    assert (rc, out, err) == (2, "", f"error: UsageError: --limit must be 1 to 1000, got {limit}")


def test_dead_letters_list_takes_the_edges_of_the_range(capsys, svc):
    for limit in ("1", "1000"):
        assert shardq(capsys, "dead-letters", "list", "--limit", limit, svc=svc)[0] == 0


# ---------------------------------------------------------------------------- job ids
@pytest.mark.parametrize("bad, said", [
    ("99999999999999999999999", "not a job id: '99999999999999999999999'"),
    ("abc", "not a job id: 'abc'"),
    ("9223372036854775808", "job_id must be an integer in [0, 2**63 - 1], got 9223372036854775808")])
def test_every_command_that_takes_a_job_id_reads_it_alike(capsys, svc, bad, said):
    said = f"argument job_id: {said}"
    for args, cmd in ((("job", bad), "job"), (("job", "show", bad), "job"), (("job", "cancel", bad), "job"),
                      (("ack", bad, "1"), "ack"), (("nack", bad, "1"), "nack")):
        rc, _, err = shardq(capsys, *args, svc=svc)
        assert (rc, err) == (2, f"error: UsageError: {said} (see shardq {cmd} --help)"), args
        assert "_ref" not in err
    for action in ("redrive", "purge"):
        rc, _, err = shardq(capsys, "dead-letters", action, "--id", bad, svc=svc)
        assert (rc, err) == (2, f"error: UsageError: {said.replace('job_id:', '--id:', 1)} "
                                "(see shardq dead-letters --help)"), action


def test_a_token_that_is_not_one_is_named_too(capsys, svc):
    rc, _, err = shardq(capsys, "ack", "5", "99999999999999999999", svc=svc)
    assert (rc, err) == (2, "error: UsageError: argument token: not a lease token: '99999999999999999999' "
                            "(see shardq ack --help)")


def test_the_job_id_type_is_named_for_argparse():
    from shardq.cli import common
    assert common.job_id.__name__ == "job id" and common.job_id("42") == 42
    assert common.job_id("3f1c-message-id") == "3f1c-message-id"  # another backend's id: kept


# ---------------------------------------------------------------------------- control characters
def test_stats_escapes_a_queue_name_with_control_characters(capsys, svc):
    svc.q.enqueue(b"x", queue=EVIL)
    try:
        rc, out, _ = shardq(capsys, "stats", svc=svc)
        assert rc == 0
        assert "\x1b" not in out and "\x07" not in out, out
        assert EVIL_SHOWN in out
        assert not any(line.startswith("fake") for line in out.splitlines()), out  # no forged row
        # the JSON form escapes it as JSON does
        rc, out, _ = shardq(capsys, "stats", "--json", svc=svc)
        assert EVIL in json.loads(out)["queues"]
    finally:
        svc.q.purge(EVIL)


def test_queue_commands_and_errors_escape_names_too(capsys, svc):
    svc.q.enqueue(b"x", queue=EVIL)
    try:
        rc, out, _ = shardq(capsys, "queue", "pause", EVIL, svc=svc)
        assert rc == 0 and out == f"paused: {EVIL_SHOWN}\n"
        assert shardq(capsys, "queue", "resume", EVIL, svc=svc)[0] == 0
        # an error that lists the queues there are (UnknownQueue) names this one escaped
        rc, _, err = shardq(capsys, "queue", "pause", "no-such-queue", svc=svc)
        assert rc == 2 and "UnknownQueue" in err and "\x1b" not in err and "\\x1b]0;pwned" in err, err
    finally:
        svc.q.purge(EVIL)


def test_dead_letter_notes_name_the_queue_escaped(capsys, svc):
    for _ in range(2):
        svc.q.enqueue(b"x", queue=EVIL)
        (lease,) = svc.q.dequeue_many(EVIL, max_jobs=1, wait=5)
        svc.q.nack(lease)  # max_deliveries 1: a dead letter
    try:
        rc, out, err = shardq(capsys, "dead-letters", "list", "--limit", "1", svc=svc)
        assert rc == 0 and json.loads(out)["queue"] == EVIL and "\x1b" not in out
        assert err.startswith(f"more: --queue {EVIL_SHOWN} --cursor "), err
        rc, out, err = shardq(capsys, "dead-letters", "redrive", svc=svc)  # queue default: none there
        assert (rc, out) == (0, "redriven: 0\n")
        assert err == f"note: no --queue given, so queue 'default'; dead letters wait in {EVIL_SHOWN} (2)", err
    finally:
        svc.q.purge_dead_letters(EVIL)
        svc.q.purge(EVIL)


@pytest.mark.parametrize("raw, escaped", [("plain", "plain"), ("caf\u00e9", "caf\u00e9"), ("a\nb", "a\\nb"),
                                          ("\x1b[2J", "\\x1b[2J"), ("tab\there", "tab\\there"),
                                          ("\u2028", "\\u2028"), ("back\\slash", "back\\\\slash")])
def test_shown_escapes_what_is_not_printable_as_repr_does(raw, escaped):
    from shardq.cli.common import shown
    assert shown(raw) == escaped


# ---------------------------------------------------------------------------- console
def console(data_dir: str, token: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k != "SHARDQ_HTTP_TOKEN"}
    if token is not None:
        env["SHARDQ_HTTP_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "shardq.cli", "console", "--data-dir", data_dir],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
                          cwd=os.path.dirname(data_dir))  # no config/shardq.toml of the repo


def test_console_refuses_to_print_a_url_with_a_token_serve_does_not_use(monkeypatch):
    given = "g" * 40
    monkeypatch.setenv("SHARDQ_HTTP_TOKEN", given)  # serve's environment
    with Service(shards=1) as s:
        url = s.http_url()
        r = console(s.data_dir, "w" * 40)  # this shell's is another
        assert r.returncode == 2 and r.stdout == "", r
        [line] = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert line.startswith(f"error: UsageError: the console at {url} refused the token from "
                               "SHARDQ_HTTP_TOKEN of this shell (HTTP 401)"), line
        assert "w" * 40 not in r.stderr
        r = console(s.data_dir, given)
        assert (r.returncode, r.stdout.strip()) == (0, f"{url}login?token={given}"), r.stderr
        assert "note:" not in r.stderr


def test_console_that_does_not_answer_still_gets_its_url_printed_unchecked():
    data = os.path.join(short_tmpdir(), "d")
    os.makedirs(os.path.join(data, "run"), mode=0o700)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(os.path.join(data, "run", "http.json"), "w") as f:
        json.dump({"url": f"http://127.0.0.1:{port}/", "auth": "token", "token_from": "env", "pid": 1}, f)
    r = console(data, "t" * 40)
    assert (r.returncode, r.stdout.strip()) == (0, f"http://127.0.0.1:{port}/login?token={'t' * 40}"), r.stderr
    assert "note: the console at" in r.stderr and "not checked" in r.stderr, r.stderr


def test_stats_of_a_backend_without_shards_prints_no_empty_shard_table(capsys):
    """``shardq stats --connect sqs://...``: the SQS backend has no shardq shards, and the
    table printed a header of shard columns with no row under it."""
    from shardq.cli import stats
    stats._table({"queues": {"emails": {"ready": 3, "in_flight": 1}}, "shards": [], "approximate": True,
                  "backend": "sqs"})
    out = capsys.readouterr().out
    assert "emails" in out and "approximate counts" in out
    assert "wal_bytes" not in out and not out.endswith("\n\n")
