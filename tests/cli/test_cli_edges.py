"""The ``shardq`` command at its edges (issue 44, items 8, 11 and 12): what a user types
first or gets wrong. Each case failed on the code before the fix. One service for the
module; the command runs in this process (``cli.main``) where it only needs the service,
and as a subprocess where the claim is about the process (serve, restore)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardq.cli.main import main as shardq_main

from support.service import REPO, Service

CONFIG = {"queues": {"default": {}, "lim": {"concurrency": 2}, "spare": {}, "held": {}}}
NO_SUCH = "error: NotFound: no such job: {} (never enqueued, or finished, cancelled or purged since)"


@pytest.fixture(scope="module")
def svc():
    with Service(config=CONFIG) as s:
        with s.connect() as s.q:
            s.q.enqueue(b"keeps 'held' listed", queue="held")
            yield s


def shardq(capsys, *args: str, svc=None) -> tuple[int, str, str]:
    """``shardq ARGS [--data-dir D]`` in this process: (exit code, stdout, stderr)."""
    argv = [*args, *(["--data-dir", svc.data_dir] if svc is not None else [])]
    try:
        rc = shardq_main(argv)
    except SystemExit as e:  # argparse: --help, --version, a usage error
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, "\n".join(l for l in err.splitlines() if l.startswith("error:"))


def run_shardq(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=cwd)


# ---------------------------------------------------------------------------- item 11
def test_bare_shardq_prints_the_help_and_exits_0(capsys):
    rc, out, err = shardq(capsys)
    assert rc == 0 and err == ""
    assert out.startswith("usage: shardq") and "job" in out and "--version" in out


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version
    rc, out, _ = shardq(capsys, "--version")
    assert rc == 0 and out.strip() == f"shardq {version('shardq')}"


def test_job_with_an_id_alone_means_show(capsys, svc):
    jid = svc.q.enqueue(b"look at me", queue="spare")
    rc, out, err = shardq(capsys, "job", str(jid), svc=svc)
    assert rc == 0, err
    shown = __import__("json").loads(out)
    assert (shown["job_id"], shown["body"], shown["state"]) == (jid, "look at me", "ready")
    assert shardq(capsys, "job", "show", str(jid), svc=svc)[1] == out
    assert svc.q.cancel(jid) == "cancelled"


def test_every_command_that_takes_a_job_id_says_no_such_job_alike(capsys, svc):
    # of shard 0, never enqueued; and one naming a shard this service lacks (ack and nack
    # called it an InvalidJob, 'not a lease of this service', where the others said NotFound)
    for unknown in (5120 * 1024, 5):
        for args in (("job", str(unknown)), ("job", "show", str(unknown)), ("job", "cancel", str(unknown)),
                     ("ack", str(unknown), "7"), ("nack", str(unknown), "7")):
            rc, _, err = shardq(capsys, *args, svc=svc)
            assert (rc, err) == (2, NO_SUCH.format(unknown)), args
    # a job that was there and is done: the same (an ack's JobGone, a cancel's "gone")
    jid = svc.q.enqueue(b"done soon", queue="spare")
    (lease,) = svc.q.dequeue_many("spare", max_jobs=1, wait=5)
    assert shardq(capsys, "ack", str(jid), str(lease.token), svc=svc)[0] == 0
    for args in (("ack", str(jid), str(lease.token)), ("job", "cancel", str(jid)), ("job", str(jid))):
        assert shardq(capsys, *args, svc=svc)[::2] == (2, NO_SUCH.format(jid)), args


def test_serve_on_a_data_dir_that_cannot_be_made_is_one_clear_line_exit_2(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    for path, why in (("/proc/nope", "No such file or directory"), (str(tmp_path / "a-file"), "not a directory"),
                      (str(tmp_path / "a-file" / "below"), "Not a directory")):
        r = run_shardq("serve", "--data-dir", path, cwd=str(tmp_path))
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        [line] = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert line.startswith(f"error: UsageError: --data-dir {path}: ") and why in line


def test_restore_of_a_file_is_a_usage_error(capsys, tmp_path):
    (tmp_path / "backup.tar").write_bytes(b"not a backup dir")
    rc, _, err = shardq(capsys, "restore", str(tmp_path / "backup.tar"), "--data-dir", str(tmp_path / "new"))
    assert rc == 2
    assert err == (f"error: UsageError: {tmp_path / 'backup.tar'} is not a shardq backup: a backup is the "
                   "directory `shardq backup` wrote, not a file")
    assert not os.path.exists(tmp_path / "new")


# ---------------------------------------------------------------------------- items 8, 11, 12: queue
def test_queue_commands_refuse_an_unknown_queue_naming_those_that_exist(capsys, svc):
    for action in ("pause", "resume", "purge", "limit"):
        extra = ("--concurrency", "3") if action == "limit" else ()
        rc, _, err = shardq(capsys, "queue", action, "nosuchqueue", *extra, svc=svc)
        assert rc == 2, err
        assert err.startswith("error: UnknownQueue: no queue 'nosuchqueue'") and "held" in err, err
        assert "--create" in err and "declare a limit" not in err
    assert "nosuchqueue" not in svc.q.stats()["queues"]  # no phantom queue


def test_a_queue_the_config_declares_is_known_before_it_holds_a_job(capsys, svc):
    assert "lim" not in svc.q.stats()["queues"]
    rc, out, err = shardq(capsys, "queue", "limit", "lim", "--concurrency", "3", svc=svc)
    assert rc == 0, err
    assert '"concurrency": 3' in out


def test_create_makes_a_new_queue_on_purpose(capsys, svc):
    rc, out, err = shardq(capsys, "queue", "pause", "brand-new", "--create", svc=svc)
    assert (rc, out.strip()) == (0, "paused: brand-new"), err
    assert svc.q.stats()["queues"]["brand-new"].get("paused")
    assert shardq(capsys, "queue", "resume", "brand-new", svc=svc)[:2] == (0, "resumed: brand-new\n")


def test_queue_purge_deletes_every_live_job_and_says_how_many(capsys, svc):
    svc.q.enqueue_many([{"body": b"a", "key": "k"}, {"body": b"b", "key": "k"}, {"body": b"c", "delay": 3600}],
                       queue="to-purge")
    held = svc.q.dequeue("to-purge", visibility=600)
    rc, out, err = shardq(capsys, "queue", "purge", "to-purge", svc=svc)
    assert (rc, out) == (0, "purged: to-purge (3 jobs deleted)\n"), err
    counts = svc.q.stats()["queues"]["to-purge"]
    assert (counts["ready"], counts["waiting"], counts["delayed"], counts["in_flight"]) == (0, 0, 0, 0)
    assert shardq(capsys, "queue", "purge", "to-purge", svc=svc)[:2] == (0, "purged: to-purge (0 jobs deleted)\n")
    assert held is not None
    rc, _, err = shardq(capsys, "queue", "purge", "to-purge", "--create", svc=svc)
    assert rc == 2 and "UsageError" in err


@pytest.mark.parametrize("flag,value,words", [
    ("--concurrency", "abc", "expected an integer, got 'abc'"),
    ("--concurrency", "0", "outside"),
    ("--rate", "fast", "expected a rate"),
    ("--burst", "x", "expected a number"),
    ("--group-concurrency", "1.5", "expected an integer"),
])
def test_queue_limit_bad_values_exit_2_naming_the_flag(capsys, svc, flag, value, words):
    rc, _, err = shardq(capsys, "queue", "limit", "lim", flag, value, svc=svc)
    assert rc == 2, err
    assert err.startswith(f"error: UsageError: argument {flag}: ") and words in err, err


def test_queue_limit_values_at_their_maximum_pass_and_one_past_exit_2(capsys, svc):
    from shardq import limits
    top = [("--concurrency", str(limits.CONCURRENCY_MAX)), ("--rate", f"{int(limits.RATE_PER_S_MAX)}/s"),
           ("--burst", str(int(limits.BURST_MAX)))]
    rc, out, err = shardq(capsys, "queue", "limit", "lim", *[w for fv in top for w in fv], svc=svc)
    assert rc == 0, err
    assert f'"burst": {limits.BURST_MAX}' in out
    for flag, value in (("--concurrency", str(limits.CONCURRENCY_MAX + 1)),
                        ("--rate", f"{int(limits.RATE_PER_S_MAX) + 1}/s"), ("--burst", str(int(limits.BURST_MAX) + 1))):
        assert shardq(capsys, "queue", "limit", "lim", flag, value, svc=svc)[0] == 2, flag
    assert shardq(capsys, "queue", "limit", "lim", "--reset", svc=svc)[0] == 0


def test_a_run_time_burst_without_a_rate_is_refused_as_the_config_refuses_it(capsys, svc):
    rc, _, err = shardq(capsys, "queue", "limit", "lim", "--burst", "5", svc=svc)
    assert rc == 2
    assert err == ("error: UsageError: queue limit lim: queues.lim.burst: needs queues.lim.rate "
                   "(burst is the tokens of the rate's bucket)")
    assert "runtime_override" not in svc.q.queue_config("lim") | svc.q.stats()["queues"].get("lim", {}).get(
        "limits", {})


# ---------------------------------------------------------------------------- a data dir that is a file
@pytest.mark.parametrize("below", [False, True], ids=["a-file", "below-a-file"])
def test_every_command_on_a_data_dir_that_is_a_file_says_not_a_data_dir_exit_5(capsys, tmp_path, below):
    """``shardq stats --data-dir README.md`` printed ``NotADirectoryError``, exit 1."""
    (tmp_path / "README.md").write_text("# not a data dir\n")
    path = str(tmp_path / "README.md" / "below" if below else tmp_path / "README.md")
    for args in (("stats",), ("dead-letters", "list"), ("dead-letters", "redrive"), ("queue", "pause", "q"),
                 ("job", "1"), ("enqueue", "x"), ("dequeue",), ("ack", "1", "2"), ("workflow", "show", "w"),
                 ("backup", str(tmp_path / "b")), ("console",), ("wal", "check"), ("worker", "json:loads")):
        rc, out, err = shardq(capsys, *args, "--data-dir", path)
        assert (rc, out) == (5, ""), (args, rc, out, err)
        assert err.startswith(f"error: NotADataDir: {path} is not a shardq data dir: ") and "\n" not in err, err
        assert "a file, not a directory" in err and "--data-dir" in err, err
    assert not os.path.exists(tmp_path / "b")


# ---------------------------------------------------------------------------- a damaged shardq.json
DAMAGED_META = {"empty": b"", "a-list": b"[1]", "no-shards": b'{"format": 1, "id": "x"}',
                "shards-a-string": b'{"format": 1, "shards": "2", "id": "x"}',
                "shards-0": b'{"format": 1, "shards": 0, "id": "x"}', "not-utf8": b"\xff\xfe",
                "id-an-int": b'{"format": 1, "shards": 1, "id": 7}'}


@pytest.mark.parametrize("content", list(DAMAGED_META.values()), ids=list(DAMAGED_META))
def test_a_damaged_shardq_json_is_refused_naming_the_file_exit_5_never_a_traceback(capsys, tmp_path, content):
    """An empty ``shardq.json``, one without ``shards`` or not an object: ``serve``, ``stats``
    and ``wal check`` printed JSONDecodeError, KeyError or AttributeError tracebacks, exit 1."""
    from shardq.datadir import DataDir
    dd = DataDir(str(tmp_path / "dd"))
    dd.init(1)
    meta = os.path.join(dd.path, "shardq.json")
    with open(meta, "wb") as f:
        f.write(content)
    for args in (("stats",), ("wal", "check"), ("dead-letters", "list")):
        rc, out, err = shardq(capsys, *args, "--data-dir", dd.path)
        assert (rc, out) == (5, ""), (args, rc, out, err)
        assert err.startswith(f"error: InvalidConfig: {meta} is damaged (") and "\n" not in err, err
    r = subprocess.run([sys.executable, "-m", "shardq", "serve", "--data-dir", dd.path], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert f"InvalidConfig: {meta} is damaged (" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- dead letters of a queue
def test_dead_letters_of_a_queue_the_service_lacks_are_refused_naming_those_that_exist(capsys, svc):
    """``dead-letters list|redrive --queue nosuch`` exited 0 saying nothing, where ``queue
    pause|resume|purge|limit`` refuse the name."""
    for action in ("list", "redrive", "purge"):
        rc, out, err = shardq(capsys, "dead-letters", action, "--queue", "nosuchqueue", svc=svc)
        assert (rc, out) == (2, ""), (action, err)
        assert err.startswith("error: UnknownQueue: no queue 'nosuchqueue'") and "held" in err, err
    assert "nosuchqueue" not in svc.q.stats()["queues"]
    # a queue that exists and holds no dead letters: as before (it holds a job; 'lim' is declared)
    for queue in ("held", "lim"):
        assert shardq(capsys, "dead-letters", "list", "--queue", queue, svc=svc)[:2] == (0, "")
        assert shardq(capsys, "dead-letters", "redrive", "--queue", queue, svc=svc)[:2] == (0, "redriven: 0\n")
        assert shardq(capsys, "dead-letters", "purge", "--queue", queue, svc=svc)[:2] == (0, "purged: 0\n")
