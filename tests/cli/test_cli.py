"""The ``shardq`` command against a running service, each command a real subprocess."""
from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from support.doc_runner import catches_sigterm
from support.service import REPO, Service, alive, short_tmpdir, wait_until

CONFIG = {"queues": {"default": {}, "once": {"max_deliveries": 1}}}


@pytest.fixture
def svc():
    with Service(config=CONFIG) as s:
        yield s


# Note: a router closed in this process just before a subprocess starts can steal the first
# bytes of the child's output (see test_router.py::test_a_closed_router_never_reads_from_a_
# reused_descriptor); the tests below keep their routers open while they run the CLI.
def cli(svc, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args, "--data-dir", svc.data_dir],
                          input=stdin, capture_output=True, timeout=60, env=env,
                          cwd=os.path.dirname(svc.data_dir))  # no config/shardq.toml picked up by accident


def out(r: subprocess.CompletedProcess) -> str:
    return r.stdout.decode()


def err_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [l for l in r.stderr.decode().splitlines() if l.startswith("error:")]


def test_enqueue_dequeue_ack(svc):
    r = cli(svc, "enqueue", "hello world", "--key", "user-1")
    assert r.returncode == 0, r.stderr
    jid = int(out(r))
    r = cli(svc, "enqueue", "-", stdin=b"\x00\xffbinary")
    assert r.returncode == 0, r.stderr
    bin_id = int(out(r))

    r = cli(svc, "dequeue", "--max", "5", "--visibility", "20")
    assert r.returncode == 0, r.stderr
    leases = {d["job_id"]: d for d in map(json.loads, out(r).splitlines())}
    assert set(leases) == {jid, bin_id}
    assert (leases[jid]["body"], leases[jid]["key"], leases[jid]["attempt"]) == ("hello world", "user-1", 1)
    assert leases[bin_id]["key"] is None
    for d in leases.values():
        r = cli(svc, "ack", str(d["job_id"]), str(d["token"]))
        assert r.returncode == 0, r.stderr
    # The same ack again: the job is gone; one error line, the one of every command that
    # names a job that does not exist (NotFound "no such job", exit 2; issue 44).
    r = cli(svc, "ack", str(jid), str(leases[jid]["token"]))
    assert r.returncode == 2, r.stderr
    assert err_lines(r) == [f"error: NotFound: no such job: {jid} (never enqueued, or finished, cancelled or "
                            "purged since)"], r.stderr
    r = cli(svc, "dequeue")
    assert r.returncode == 3 and out(r) == ""  # nothing to lease


def test_stats_table_and_json(svc):
    q = svc.connect()  # left open until the end: see the note on routers and subprocesses
    for i in range(3):
        q.enqueue(f"j{i}".encode(), key="k")  # 1 ready, 2 waiting behind it
    q.enqueue(b"later", delay=60)
    pids = q.ping()
    r = cli(svc, "stats", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(out(r))
    assert st["queues"]["default"] == {"ready": 1, "delayed": 1, "waiting": 2, "in_flight": 0, "dead": 0, "keys": 1}
    assert [sh["pid"] for sh in st["shards"]] == pids
    assert all(sh["wal_bytes"] > 0 for sh in st["shards"])
    r = cli(svc, "stats")
    assert r.returncode == 0, r.stderr
    lines = out(r).splitlines()
    header = lines[0].split()
    assert header[:7] == ["queue", "ready", "delayed", "waiting", "in_flight", "dead", "keys"]
    row = next(l.split() for l in lines if l.startswith("default"))
    assert row == ["default", "1", "1", "2", "0", "0", "1"]
    assert any(l.split()[:2] == ["0", str(pids[0])] for l in lines)
    assert any(l.split()[:2] == ["1", str(pids[1])] for l in lines)
    q.close()


def test_dead_letters_list_and_redrive(svc):
    r = cli(svc, "enqueue", "poison", "--queue", "once", "--key", "p")
    jid = int(out(r))
    lease = json.loads(out(cli(svc, "dequeue", "--queue", "once")))
    r = cli(svc, "nack", str(lease["job_id"]), str(lease["token"]), "--error", "it broke")
    assert r.returncode == 0, r.stderr
    r = cli(svc, "dead-letters", "list", "--queue", "once")
    assert r.returncode == 0, r.stderr
    dead = [json.loads(l) for l in out(r).splitlines()]
    assert dead == [{"queue": "once", "job_id": jid, "key": "p", "attempts": 1, "error": "it broke",
                     "body": "poison"}]
    r = cli(svc, "dead-letters", "redrive", "--queue", "once")
    assert r.returncode == 0 and out(r).strip() == "redriven: 1", r.stderr
    assert out(cli(svc, "dead-letters", "list", "--queue", "once")) == ""
    again = json.loads(out(cli(svc, "dequeue", "--queue", "once")))
    assert (again["job_id"], again["attempt"]) == (jid, 1)


@pytest.mark.parametrize("args, words", [
    (["enqueue", ""], "empty"),
    (["enqueue", "x", "--delay", "-1"], "delay"),
    (["enqueue", "x", "--delay", "nan"], "delay"),
    (["enqueue", "x", "--key", ""], "key"),
    (["enqueue", "x", "--priority", str(2**40)], "priority"),
    (["dequeue", "--max", "0"], "max_jobs"),
    (["dequeue", "--wait", "-5"], "wait"),
])
def test_invalid_input_exits_2_with_one_error_line(svc, args, words):
    r = cli(svc, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = err_lines(r)
    assert len(errors) == 1 and errors[0].startswith("error: InvalidJob:") and words in errors[0], r.stderr
    assert "Traceback" not in r.stderr.decode()
    with svc.connect() as q:
        assert q.stats()["queues"].get("default", {}).get("ready", 0) == 0


def test_client_command_on_a_dir_that_is_not_a_data_dir(tmp_path):
    class Fake:
        data_dir = str(tmp_path / "nothing-here")
    r = cli(Fake, "stats")
    assert r.returncode == 5  # a setup error, not bad input
    assert err_lines(r) and err_lines(r)[0].startswith("error: NotADataDir:"), r.stderr
    assert "not a shardq data dir" in err_lines(r)[0] and "Traceback" not in r.stderr.decode()


def test_wal_check_ok_then_corrupt(svc):
    for i in range(5):
        assert cli(svc, "enqueue", f"job {i}", "--key", "k").returncode == 0
    r = cli(svc, "wal", "check")
    assert r.returncode == 0, r.stderr
    lines = out(r).splitlines()
    assert lines and all(l.startswith("ok") for l in lines), lines
    assert sum(int(l.split("records=")[1].split()[0]) for l in lines) >= 5
    svc.stop()
    seg = max(glob.glob(os.path.join(svc.data_dir, "shard-*", "*.wal")), key=os.path.getsize)
    with open(seg, "r+b") as f:
        f.seek(8 + 8 + 2)  # inside the first record's payload; more records follow
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = cli(svc, "wal", "check")
    assert r.returncode == 1
    bad = [l for l in out(r).splitlines() if l.startswith("corrupt")]
    assert len(bad) == 1 and seg in bad[0] and "at offset 8" in bad[0], out(r)


# ---------------------------------------------------------------------- exit codes and messages
def run_shardq(*args: str, cwd: str | None = None, shell: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if shell is not None:
        return subprocess.run(shell, shell=True, capture_output=True, timeout=60, env=env, cwd=cwd,
                              executable="/bin/bash")
    return subprocess.run([sys.executable, "-m", "shardq", *args], capture_output=True, timeout=60,
                          env=env, cwd=cwd)


def test_python_dash_m_shardq_is_the_command():
    r = run_shardq("--help")
    assert r.returncode == 0 and "serve" in out(r) and "dead-letters" in out(r)


def test_wal_repair_without_a_path_is_a_usage_error():
    r = run_shardq("wal", "repair")
    assert r.returncode == 2 and b"required: path" in r.stderr and b"InvalidJob" not in r.stderr, r.stderr


def test_wal_check_of_a_missing_path_is_one_error_line(tmp_path):
    r = run_shardq("wal", "check", str(tmp_path / "nothing"))
    assert r.returncode == 2, r.stderr
    assert err_lines(r) == [f"error: UsageError: {tmp_path / 'nothing'}: no such directory"]
    assert b"Traceback" not in r.stderr


def test_wal_check_of_a_dir_without_logs_is_not_reported_clean(tmp_path):
    r = run_shardq("wal", "check", str(tmp_path))
    assert r.returncode == 2 and out(r) == "", (r.returncode, r.stdout, r.stderr)
    assert err_lines(r)[0].startswith("error: UsageError:") and "neither a shardq data dir" in err_lines(r)[0]


def test_wal_check_of_a_data_dir_checks_every_shard(svc):
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(20)])
        r = run_shardq("wal", "check", svc.data_dir)
    assert r.returncode == 0, r.stderr
    checked = {l.split()[1].split("/shard-")[1].split("/")[0] for l in out(r).splitlines()}
    assert checked == {"0", "1"}, out(r)


def test_stats_exits_1_when_every_shard_is_down(svc):
    # The supervisor runs (stopped, so it cannot restart them) while both shards are dead:
    # the service is there, its shards are not, and stats says so shard by shard.
    shards = svc.shard_pids()
    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        for pid in shards:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in shards), 10, 0.01, "the shards gone")
        r = cli(svc, "stats")
    finally:
        os.kill(svc.proc.pid, signal.SIGCONT)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert out(r).count("DOWN") == 2 and b"Traceback" not in r.stderr


def test_a_command_against_a_stopped_service_says_so_within_a_second(svc):
    svc.stop()
    started = time.monotonic()
    r = cli(svc, "enqueue", "hi")
    took = time.monotonic() - started
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert err_lines(r) == [f"error: ServiceNotRunning: no shardq service is running on {svc.data_dir}: "
                            f"start it with shardq serve --data-dir {svc.data_dir}"], r.stderr
    assert took < 5, f"{took:.1f} s (the router's retry_s is 15 s)"  # a Python start-up, plus < 1 s


def test_a_bad_argument_is_one_error_line_exit_2():
    r = run_shardq("job", "show", "abc")
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode().splitlines() == [
        "error: UsageError: argument job_id: not a job id: 'abc' (see shardq job --help)"]
    r = run_shardq("outbox", "relay")
    assert r.returncode == 2 and r.stderr.decode().splitlines() == [
        "error: UsageError: the following arguments are required: --dsn (see shardq outbox relay --help)"]
    r = run_shardq("enqeue", "x")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"invalid choice: 'enqeue'" in r.stderr


def test_dead_letters_list_without_a_queue_lists_every_queue(svc):
    with svc.connect() as q:
        mine = q.enqueue(b"in once", queue="once", key="a")
        q.nack(q.dequeue("once"), error="boom")
        q.enqueue(b"live, not dead")  # a queue with jobs but no dead letters lists nothing
        r = cli(svc, "dead-letters", "list")
    assert r.returncode == 0, r.stderr
    assert [(d["queue"], d["job_id"]) for d in map(json.loads, out(r).splitlines())] == [("once", mine)]
    r = cli(svc, "dead-letters", "list", "--cursor", "x")
    assert r.returncode == 2 and err_lines(r)[0].startswith("error: UsageError: --cursor needs --queue")
    r = cli(svc, "dead-letters", "redrive")  # queue default holds none: say where they are
    assert r.returncode == 0 and out(r) == "redriven: 0\n"
    assert "dead letters wait in once (1)" in r.stderr.decode(), r.stderr


def test_bodies_print_decoded_task_text_or_base64_and_raw_on_request(svc):
    from shardq.tasks import body as taskbody
    task = taskbody.encode("myapp.tasks.send_welcome", [42, b"\x00\xff"], {"template": "short"})
    binary = b"\x00\xff\xfe binary"
    with svc.connect() as q:
        ids = {q.enqueue(body, queue="once", key=f"k{i}"): body
               for i, body in enumerate([task, "héllo".encode(), binary])}
        for lease in q.dequeue_many("once", max_jobs=3):
            q.nack(lease)
        r = cli(svc, "dead-letters", "list", "--queue", "once")
        raw = cli(svc, "dead-letters", "list", "--queue", "once", "--raw")
        shown = cli(svc, "job", "show", str(next(iter(ids))))
    assert r.returncode == 0 and raw.returncode == 0 and shown.returncode == 0, (r.stderr, raw.stderr, shown.stderr)
    letters = {d["job_id"]: d for d in map(json.loads, out(r).splitlines())}
    as_task, as_text, as_bytes = (letters[j] for j in ids)
    assert as_task["task"] == {"name": "myapp.tasks.send_welcome", "args": [42, {"base64": "AP8="}],
                               "kwargs": {"template": "short"}} and "body" not in as_task
    assert as_text["body"] == "héllo"
    assert base64.b64decode(as_bytes["body_base64"]) == binary and "body" not in as_bytes
    exact = {d["job_id"]: base64.b64decode(d["body_base64"]) for d in map(json.loads, out(raw).splitlines())}
    assert exact == ids
    info = json.loads(out(shown))
    assert info["task"]["name"] == "myapp.tasks.send_welcome" and info["body_bytes"] == len(task)


def test_job_show_cuts_a_long_text_body_on_a_character(svc):
    body = ("a" + "é" * 600).encode()  # 1,201 bytes: byte 1,000 is the middle of an "é"
    with svc.connect() as q:
        jid = q.enqueue(body)
        r = cli(svc, "job", "show", str(jid))
        q.ack(q.dequeue())
    info = json.loads(out(r))
    assert info["body"] == "a" + "é" * 499 and info["body_bytes"] == 1201  # no "\ufffd" at the cut


def test_serve_on_a_held_data_dir_names_the_pid_holding_it(svc):
    r = cli(svc, "serve", "--shards", "2")
    assert r.returncode == 5
    assert err_lines(r) == [f"error: DataDirLocked: {svc.data_dir}/supervisor.lock is held by another "
                            f"running process (pid {svc.proc.pid})"], r.stderr


def test_serve_on_a_read_only_data_dir_says_it_must_be_writable():
    from shardq.datadir import DataDir
    data = os.path.join(short_tmpdir(), "data")
    DataDir(data).init(1)  # a data dir made by an earlier run, now on a read-only disk
    serve = [sys.executable, "-m", "shardq.cli", "serve", "--data-dir", data, "--shards", "1"]
    env = dict(os.environ, PYTHONPATH=REPO)
    try:
        if os.geteuid() == 0:  # root writes through permissions: make the file system read-only
            r = subprocess.run(["unshare", "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"',
                                data, *serve], capture_output=True, timeout=60, env=env)
            why = "Read-only file system"
        else:
            os.chmod(data, 0o500)
            r = subprocess.run(serve, capture_output=True, timeout=60, env=env)
            why = "Permission denied"
    finally:
        os.chmod(data, 0o700)
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    assert r.returncode == 5, r.stderr
    assert err_lines(r) == [f"error: DataDirNotWritable: the data dir {data} must be writable by this user "
                            f"(uid {os.geteuid()}): {why}: {data}/supervisor.lock"], r.stderr


def test_stats_into_a_closed_pipe_prints_no_traceback(svc):
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "queue": f"queue-{i}"} for i in range(400)])  # a long table
        r = run_shardq(shell=f"{sys.executable} -m shardq stats --data-dir {svc.data_dir} | head -n 1")
    assert r.returncode == 0 and out(r).startswith("queue"), r.stderr
    assert b"Traceback" not in r.stderr and b"BrokenPipe" not in r.stderr, r.stderr


def test_worker_idempotency_in_a_missing_directory_is_a_usage_error(svc, tmp_path):
    r = cli(svc, "worker", "json:dumps", "--idempotency", str(tmp_path / "no" / "such" / "e.sqlite"))
    assert r.returncode == 2, r.stderr
    assert err_lines(r)[0].startswith("error: UsageError: --idempotency") and b"Traceback" not in r.stderr


def test_worker_takes_the_data_dir_from_the_config(svc, tmp_path):
    """One flag name and one default everywhere: the worker reads --config like the rest."""
    (tmp_path / "shardq.toml").write_text(f'[service]\ndata_dir = "{svc.data_dir}"\n')
    (tmp_path / "cfg_handler.py").write_text(
        "import os, signal\n"
        "def handle(ctx):\n"
        "    open('seen.txt', 'wb').write(ctx.body)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n")
    with svc.connect() as q:
        q.enqueue(b"for the worker")
        r = run_shardq("worker", "cfg_handler:handle", "--config", "shardq.toml", "--concurrency", "1",
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "seen.txt").read_bytes() == b"for the worker"


@pytest.mark.parametrize("command", ["ack", "nack"])
def test_ack_and_nack_take_no_queue_flag(svc, command):
    r = cli(svc, command, "1", "1", "--queue", "default")
    assert r.returncode == 2 and b"unrecognized arguments: --queue" in r.stderr


def test_empty_key_message_speaks_cli_not_python(svc):
    r = cli(svc, "enqueue", "x", "--key", "")
    assert r.returncode == 2 and "None" not in err_lines(r)[0], err_lines(r)


def test_exit_code_table_in_the_docs_is_the_code():
    from shardq.cli import exits
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        text = f.read()
    section = text.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| code")]
    documented = [(int(l.split("|")[1]), l.split("|")[2].strip()) for l in rows]
    assert documented == exits.TABLE


# ---------------------------------------------------------------------- a worker's queues at start
TASKS_MODULE = (
    "import shardq\n"
    "app = shardq.App({data_dir!r})\n"
    "@app.task(queue='emails')\n"
    "def send(ctx, to):\n"
    "    pass\n")


def test_a_task_worker_on_a_queue_no_task_uses_exits_2_naming_the_queues(svc, tmp_path):
    (tmp_path / "typo_tasks.py").write_text(TASKS_MODULE.format(data_dir=svc.data_dir))
    with svc.connect() as q:
        q.enqueue(b"waiting", queue="once")
        r = run_shardq("worker", "typo_tasks", "--queue", "email", "--data-dir", svc.data_dir, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert err_lines(r) == ["error: UsageError: --queue email: no task of typo_tasks is sent to this queue and "
                            "it holds no jobs, so nothing could ever run there (the tasks' queues: emails); "
                            "queues with jobs: once (1)"], r.stderr


def test_a_handler_worker_on_a_queue_never_seen_warns_and_keeps_waiting(svc, tmp_path):
    (tmp_path / "typo_handler.py").write_text("def handle(ctx):\n    pass\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    with svc.connect() as q:
        q.enqueue(b"for the right queue")
        proc = subprocess.Popen([sys.executable, "-m", "shardq", "worker", "typo_handler:handle", "--queue",
                                 "defualt", "--data-dir", svc.data_dir], cwd=str(tmp_path), env=env,
                                stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            warning = wait_until(lambda: next((l.rstrip("\n") for l in lines if "never seen" in l), None),
                                 30, 0.01, "the warning")
            # a warning, not an exit: jobs may still come; stopped once it handles SIGTERM
            wait_until(lambda: catches_sigterm(proc.pid), 30, 0.01, "the worker running")
            assert proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(30)
            reader.join(10)
            proc.stderr.close()
        q.ack(q.dequeue())
    assert rc == 0
    assert warning.endswith("shardq.worker WARNING queue 'defualt' holds no jobs and the service has never seen "
                            "it (a typo?); waiting for jobs there anyway; queues with jobs: default (1)"), warning


def test_a_worker_works_off_a_queue_taken_out_of_the_config_while_it_holds_jobs(tmp_path):
    """With declare_queues, a queue removed from the config whose jobs a shard still holds:
    the worker refused it (UnknownQueue, exit 2, 'no job can ever be sent to it ... queues
    with jobs: emails (2)': its queue_config asked shard 0 only) and the jobs could not be
    worked off. The shards holding it answer for it."""
    config = {"service": {"declare_queues": True}, "queues": {"default": {}, "emails": {}}}
    (tmp_path / "drain_handler.py").write_text("def handle(ctx):\n    pass\n")
    with Service(config=config, shards=2) as svc:
        with svc.connect() as q:
            q.enqueue_many([{"body": b"x", "key": "k"}, {"body": b"y", "key": "k"}], queue="emails")
        svc.stop()
        svc.config["queues"].pop("emails")
        svc.start()
        r = run_shardq("worker", "drain_handler:handle", "--queue", "emails", "--burst", "--data-dir",
                       svc.data_dir, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert "2 ok" in r.stderr.decode() and not err_lines(r)
        with svc.connect() as q:
            assert q.stats()["queues"]["emails"]["ready"] == 0


def test_a_worker_on_an_undeclared_queue_exits_2(tmp_path):
    config = {"service": {"declare_queues": True}, "queues": {"default": {}, "emails": {}}}
    with Service(config=config, shards=1) as declared:
        with declared.connect() as q:
            q.enqueue(b"x", queue="emails")
            r = run_shardq("worker", "json:dumps", "--queue", "emails2", "--data-dir", declared.data_dir,
                           cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert err_lines(r) == [
        "error: UnknownQueue: --queue emails2: the service does not declare this queue (declare_queues = true), "
        "so no job can ever be sent to it: fix the name, or declare it as [queues.emails2] in the service's "
        "config; queues with jobs: emails (1)"], r.stderr
