"""The supervisor (``shardq serve``) against real shard processes: restarts, hung shards,
crash loops, corrupt logs, refusals at start, and clean shutdown."""
from __future__ import annotations

import glob
import os
import re
import signal
import shutil
import subprocess
import sys
import threading

import psutil
import pytest

import shardq
from support.service import REPO, Service, parked_long_poll, restarted, short_tmpdir, wait_until
from shardq.errors import ShardUnavailable
from shardq.client.router import shard_for_key, shard_of_job


def keys_on_shard(shard: int, n: int = 1, shards: int = 2) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        if shard_for_key(f"k{i}", shards) == shard:
            out.append(f"k{i}")
        i += 1
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def log_text(svc) -> str:
    with open(svc.log_path, "rb") as f:
        return f.read().decode(errors="replace")


def serve(data_dir: str, shards: int, config: str | None = None, timeout: float = 60):
    """Run ``shardq serve`` expecting it to refuse to start; returns (rc, output)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "shardq.cli", "serve", "--data-dir", data_dir, "--shards", str(shards)]
    if config:
        cmd += ["--config", config]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    return r.returncode, r.stderr + r.stdout


def no_process_uses(data_dir: str) -> bool:
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(data_dir in arg for arg in p.info["cmdline"] or ()) and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True



# ---------------------------------------------------------------------- refusals at start
def test_starting_with_another_shard_count_is_refused():
    with Service(shards=2) as svc:
        with svc.connect() as q:
            jid = q.enqueue(b"kept", key="a")
        svc.stop()
        rc, out = serve(svc.data_dir, 3)
        assert rc == 5  # a setup error (docs/operations.md, "Exit codes"), not bad job input
        assert "ShardCountMismatch" in out and "2 shards" in out and "--shards 2" in out, out
        assert "event=spawn" not in out  # refused before any shard started
        svc.log.close()
        svc.start()  # the data dir is untouched
        with svc.connect() as q:
            assert q.shards == 2
            assert q.dequeue().job_id == jid


def test_the_default_shard_count_is_an_existing_data_dirs_own():
    """service.shards = 0 gives a new data dir a shard per two CPUs, and an existing one
    its own count on any machine: it was computed afresh and refused a data dir made on a
    host with other CPUs (ShardCountMismatch, exit 5), a restored backup's too."""
    from shardq.config import default_shards
    made = default_shards() + 1  # a count this machine's default is not
    with Service(shards=made) as svc:
        with svc.connect() as q:
            jid = q.enqueue(b"kept", key="a")
        svc.stop()
        with shardq.open(svc.data_dir) as q:  # the default config, no count given
            assert q.shards == made
            assert q.dequeue().job_id == jid


def test_second_serve_on_a_running_data_dir_is_refused():
    with Service() as svc:
        pids = svc.shard_pids()
        rc, out = serve(svc.data_dir, 2)
        assert rc == 5 and "error: DataDirLocked:" in out and "held by another running process" in out, out
        assert svc.shard_pids() == pids


def test_key_file_readable_by_others_is_refused_with_an_auth_error():
    with Service() as svc:
        svc.stop()
        key = os.path.join(svc.data_dir, "authkey")
        os.chmod(key, 0o644)
        with pytest.raises(shardq.AuthError, match="0644"):
            shardq.connect(svc.data_dir)
        rc, out = serve(svc.data_dir, 2)
        assert rc == 5
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert errors and "AuthError" in errors[-1] and "0644" in errors[-1], out[-3000:]
        assert "event=spawn" not in out, "shards were started (and crash-looped) on an unsafe key file"
        os.chmod(key, 0o600)


# ---------------------------------------------------------------------- restarts and health
def test_killed_shard_is_restarted_with_its_jobs():
    with Service() as svc:
        k0 = keys_on_shard(0)[0]
        with svc.connect() as q:
            jid = q.enqueue(b"on shard 0", key=k0)
            old = q.ping()
            os.kill(old[0], signal.SIGKILL)
            new = restarted(svc, 0, old[0])
            assert q.ping() == [new, old[1]]
            lease = q.dequeue()
            assert (lease.job_id, lease.body) == (jid, b"on shard 0")
            q.ack(lease)
        log = log_text(svc)
        assert re.search(rf"event=shard-exit shard=0 pid={old[0]} exit=signal=SIGKILL", log), log[-2000:]
        assert "event=shard-restart shard=0 restarts=1" in log
        assert not alive(old[0])


def test_a_config_past_a_command_lines_limit_starts_and_restarts_its_shards():
    """The shards read the config from a file of the run dir, not their command line: one
    argument holds at most 128 KiB on Linux, and a config of ~850 declared queues failed to
    spawn any shard (after a SIGHUP added them, the next restart took serve down). Nor is it
    on the command line for every local user to read."""
    queues = {f"declared-queue-{i:05d}": {"visibility_timeout": 60 + i % 7} for i in range(3000)}
    with Service(shards=2, config={"queues": queues}) as svc:
        with svc.connect() as q:
            assert q.queue_config("declared-queue-02999")["visibility_timeout"] == 60 + 2999 % 7
            old = q.ping()
            args = psutil.Process(old[0]).cmdline()
            assert "--config-file" in args and len(" ".join(args)) < 1000, args
            os.kill(old[0], signal.SIGKILL)
            new = restarted(svc, 0, old[0])
            assert q.ping() == [new, old[1]]
            key = keys_on_shard(0)[0]
            q.enqueue(b"after the restart", key=key, queue="declared-queue-00001")
            lease = q.dequeue("declared-queue-00001")
            assert lease.body == b"after the restart"
            q.ack(lease)


def test_hung_shard_is_killed_and_restarted():
    with Service(config={"service": {"health_timeout": 1}}) as svc:
        k0 = keys_on_shard(0)[0]
        with svc.connect(retry_s=15) as q:
            before = q.enqueue(b"before", key=k0)
            old = q.ping()
            os.kill(old[0], signal.SIGSTOP)
            try:
                # A call to the hung shard waits, then rides out the restart.
                result = {}
                t = threading.Thread(target=lambda: result.update(id=q.enqueue(b"during", key=k0)))
                t.start()
                # The other shard keeps serving meanwhile.
                with svc.connect(retry_s=2, request_timeout_s=2) as q1:
                    elsewhere = q1.enqueue(b"elsewhere", queue="other", key=keys_on_shard(1)[0])
                    assert shard_of_job(elsewhere) == 1
                new = restarted(svc, 0, old[0])
                t.join(20)
                assert shard_of_job(result["id"]) == 0
            finally:
                if alive(old[0]):
                    os.kill(old[0], signal.SIGCONT)
            assert new != old[0] and not alive(old[0])
            assert q.ping() == [new, old[1]]
            bodies = []
            while (lease := q.dequeue()) is not None:
                bodies.append((lease.job_id, lease.body))
                q.ack(lease)
            assert bodies == [(before, b"before"), (result["id"], b"during")]
            assert q.dequeue("other").job_id == elsewhere
        log = log_text(svc)
        assert re.search(rf"event=shard-hung shard=0 pid={old[0]}", log), log[-2000:]
        assert "event=shard-restart shard=0" in log


def test_a_crash_looping_shard_is_restarted_with_backoff_until_it_starts_and_the_others_serve():
    """No give-up (issue 9): a shard that cannot start is retried with capped exponential
    backoff while the others serve; stats and the log say why; once the cause is gone it
    comes back by itself with its jobs."""
    cfg = {"service": {"restart_backoff_max": 1}}  # 0.5 s doubled once, then held at the cap
    with Service(config=cfg) as svc:
        k0, k1 = keys_on_shard(0)[0], keys_on_shard(1)[0]
        with svc.connect() as q:
            kept = q.enqueue(b"kept on shard 0", key=k0)
        shard_dir = os.path.join(svc.data_dir, "shard-0")
        os.rename(shard_dir, shard_dir + ".away")
        with open(shard_dir, "w"):  # a file where the shard's directory should be: it cannot start
            pass
        first = svc.shard_pids()
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: len(re.findall(r"event=shard-restart shard=0 .*in_s=1 ", log_text(svc))) >= 2, 30,
                   what="restarts backing off to the 1 s cap")
        log = log_text(svc)
        delays = [float(d) for d in re.findall(r"event=shard-restart shard=0 restarts=\d+ in_s=([\d.]+)", log)]
        assert delays[:3] == [0.5, 1, 1] and set(delays[3:]) <= {1}, delays
        assert re.search(r"WARNING event=shard-exit shard=0 pid=\d+ exit=code=4 reason=io-error "
                         r'detail="cannot open its log: .*File exists', log), log[-3000:]
        assert "event=shard-failed" not in log  # never given up on
        with svc.connect(retry_s=0.5, request_timeout_s=2) as q:
            assert shard_of_job(q.enqueue(b"still served", key=k1, queue="other")) == 1
            with pytest.raises(ShardUnavailable):
                q.enqueue(b"nowhere", key=k0)
            st = q.stats()["shards"][0]  # from the supervisor's published status
            assert not st["available"] and st["status"] in ("restarting", "starting"), st
            assert st["reason_kind"] == "io_error" and "File exists" in st["reason"], st
        out = subprocess.run([sys.executable, "-m", "shardq.cli", "stats", "--data-dir", svc.data_dir],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env=dict(os.environ, PYTHONPATH=REPO))
        assert out.returncode == 1, out.stderr  # a shard is down: the service failed
        assert re.search(r"^0 +DOWN  (restarting in [\d.]+ s|starting): cannot open its log: .*File exists",
                         out.stdout, re.M), out.stdout
        os.unlink(shard_dir)
        os.rename(shard_dir + ".away", shard_dir)
        with svc.connect(retry_s=1) as q:  # within one backoff step, without a restart of serve
            lease = wait_until(lambda: q.dequeue(), 15, 0.2, "shard 0 back, by itself, with its job")
            assert (lease.job_id, lease.body) == (kept, b"kept on shard 0")
            q.ack(lease)
            assert q.stats()["shards"][0]["status"] == "ready"
        assert svc.proc.poll() is None  # the service itself stayed up throughout


def test_supervisor_sigkill_takes_its_shards_with_it():
    with Service() as svc:
        shards = svc.shard_pids()
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(10)
        wait_until(lambda: not any(alive(p) for p in shards), 10, what="orphaned shards to die")
        svc.log.close()
        svc.start()  # locks and sockets were released
        assert set(svc.shard_pids()).isdisjoint(shards)


def test_sigterm_stops_every_shard_cleanly_with_exit_code_0():
    with Service() as svc:
        with svc.connect() as q:
            jid = q.enqueue(b"survives a clean stop", key="a")
        blocked = svc.connect(retry_s=1)
        t, outcome = parked_long_poll(blocked, "idle", 30)
        pids = svc.shard_pids()
        rc = svc.stop()
        t.join(10)
        blocked.close()
        assert rc == 0, svc.tail()
        assert not any(alive(p) for p in pids)
        log = log_text(svc)
        for i, pid in enumerate(pids):
            assert re.search(rf"shard-{i} pid={pid} INFO stopped cleanly", log), log[-3000:]
        assert "Traceback" not in log
        assert outcome and (outcome[0] == [] or isinstance(outcome[0], shardq.ShardqError)), outcome
        svc.log.close()
        svc.start()
        with svc.connect() as q:
            assert q.dequeue().job_id == jid


# ---------------------------------------------------------------------- corrupt log
def test_corrupt_log_mid_segment_fails_the_shard_with_file_and_offset_and_the_others_serve():
    k0, k1 = keys_on_shard(0)[0], keys_on_shard(1)[0]
    with Service() as svc:
        with svc.connect() as q:
            for i in range(10):
                q.enqueue(f"job {i}".encode(), key=k0)  # one record per call
            elsewhere = q.enqueue(b"on shard 1", key=k1)
        assert svc.stop() == 0
        segments = sorted(glob.glob(os.path.join(svc.data_dir, "shard-0", "*.wal")))
        seg = segments[-1]
        with open(seg, "rb") as f:
            data = bytearray(f.read())
        from shardq.wal.format import HEADER, HEADER_BYTES, MAGIC_BYTES, SYNC_MARK
        offsets, off = [], MAGIC_BYTES  # the magic, then records (shardq/wal/format.py)
        while off + HEADER_BYTES <= len(data):
            _, length, _, _, _, flags, _ = HEADER.unpack_from(data, off)
            if length == 0:
                break  # the preallocated zeros after the last record
            if not flags & SYNC_MARK:  # the jobs' records: a sync mark (written as the loop goes
                offsets.append(off)    # idle, so where it falls depends on timing) has a 1-byte payload
            off += HEADER_BYTES + length
        assert len(offsets) >= 10
        bad = offsets[4]
        data[bad + HEADER_BYTES + 3] ^= 0xFF  # a byte inside the 5th record's payload; 5 good records follow
        with open(seg, "wb") as f:
            f.write(data)

        svc.log.close()
        svc.wait_for = [1]  # issue 15: the service starts; only shard 0 is left down
        svc.start()
        with svc.connect(retry_s=0.5) as q:
            st = wait_until(lambda: (lambda s: s["status"] == "failed" and s)(q.stats()["shards"][0]), 10,
                            what="shard 0 reported failed")
            assert st["reason_kind"] == "corrupt_log" and f"{seg} at offset {bad}" in st["reason"], st
            assert q.dequeue().job_id == elsewhere  # the other shard serves
        out = log_text(svc)
        out = out[out.rindex("event=start "):]  # this start's lines (the log file is appended to)
        failed = [l for l in out.splitlines() if "event=shard-failed shard=0" in l]
        assert failed and " ERROR " in failed[0] and seg in failed[0] and f"offset {bad}" in failed[0], out[-3000:]
        assert re.search(rf"event=shard-exit shard=0 .*reason=corrupt-log path={re.escape(seg)} offset={bad}", out)
        assert re.search(r"ERROR event=shard-down shard=0 status=failed reason=\"corrupt log", out), out[-3000:]
        assert out.count("event=spawn shard=0") == 1, "a corrupt log must not be retried"
        assert svc.stop() == 0
        wait_until(lambda: no_process_uses(svc.data_dir), 10, what="no shard left running")
        # The bytes were not "repaired" away behind the operator's back.
        with open(seg, "rb") as f:
            assert f.read() == bytes(data)


# ---------------------------------------------------------------------- start() fails cleanly
# Each way start() can fail once it holds the lock: it must raise, leave no shard process or
# thread of its own running, and release the data dir, so the next start() works (issue 30).
DUP_SCHEDULE_MODULE = '''
import shardq
app = shardq.App("unused")
@app.periodic(every_s=60, name="x")
def tick(ctx):
    pass
'''


def _dup_schedule(monkeypatch, tmp):
    name = f"dup_schedule_{os.path.basename(tmp)}"
    with open(os.path.join(tmp, name + ".py"), "w") as f:
        f.write(DUP_SCHEDULE_MODULE)
    monkeypatch.syspath_prepend(tmp)
    monkeypatch.delitem(sys.modules, name, raising=False)  # imported by the start, undone after
    return {"schedules": {"x": {"every_s": 60, "body": "config", "queue": "cron"}},
            "service": {"schedule_modules": [name]}}, shardq.ShardqError, "two schedules are named 'x'"


def _bad_schedule_module(monkeypatch, tmp):
    return ({"service": {"schedule_modules": ["no_such_module_for_shardq_tests"]}},
            shardq.InvalidConfig, "cannot import")


def _scheduler_thread_fails(monkeypatch, tmp):
    from shardq.service.scheduler import Scheduler

    def no_thread(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(Scheduler, "start", no_thread)
    return ({"schedules": {"x": {"every_s": 60, "body": "config", "queue": "cron"}}},
            RuntimeError, "can't start new thread")


def _second_spawn_fails(monkeypatch, tmp):
    real = subprocess.Popen
    spawned = []

    def popen(cmd, *a, **kw):
        if "shardq.shard.process" in cmd:
            spawned.append(cmd)
            if len(spawned) == 2:
                raise OSError(11, "Resource temporarily unavailable")
        return real(cmd, *a, **kw)
    monkeypatch.setattr(subprocess, "Popen", popen)
    return {}, ShardUnavailable, "cannot start shard 1: .*Resource temporarily unavailable"


def _interrupted_while_waiting(monkeypatch, tmp):
    from shardq.service.supervisor import Supervisor
    real = Supervisor._poll_once

    def poll_then_ctrl_c(self, timeout):
        real(self, timeout)
        if any(h.proc for h in self.handles):  # shards spawned: a Ctrl-C now
            raise KeyboardInterrupt
    monkeypatch.setattr(Supervisor, "_poll_once", poll_then_ctrl_c)
    return {}, KeyboardInterrupt, None


def _monitor_thread_fails_to_start(monkeypatch, tmp):
    real = threading.Thread.start

    def start(self):
        if self.name == "shardq-supervisor":
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    return {}, RuntimeError, "can't start new thread"


START_FAILURES = [  # (how, background modes it applies to)
    (_dup_schedule, (True, False)),
    (_bad_schedule_module, (True, False)),
    (_scheduler_thread_fails, (True, False)),
    (_second_spawn_fails, (True, False)),
    (_interrupted_while_waiting, (False,)),   # in the embedded mode the monitor thread polls
    (_monitor_thread_fails_to_start, (True,)),
]


@pytest.mark.parametrize("inject, background", [
    pytest.param(f, bg, id=f"{f.__name__.lstrip('_')}-{'embedded' if bg else 'foreground'}")
    for f, modes in START_FAILURES for bg in modes])
def test_a_failed_start_stops_everything_it_started_and_the_next_start_works(monkeypatch, inject, background):
    from shardq.service.supervisor import Supervisor
    tmp = short_tmpdir()
    data = os.path.join(tmp, "data")
    config, error, words = inject(monkeypatch, tmp)
    pids = []
    real_spawn = Supervisor._spawn

    def spawn(self, h):
        real_spawn(self, h)
        pids.append(h.proc.pid)
    monkeypatch.setattr(Supervisor, "_spawn", spawn)
    sup = Supervisor(data, config, 2)
    try:
        with pytest.raises(error, match=words):
            sup.start(background=background, start_timeout=30)
        assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
        assert sup._thread is None or not sup._thread.is_alive()
        assert sup.scheduler is None
        assert not [t for t in threading.enumerate() if t.name == "shardq-scheduler"]
        monkeypatch.undo()  # the next start is a plain one
        again = Supervisor(data, {}, 2).start(background=True)  # no DataDirLocked
        try:
            with shardq.connect(data) as q:
                assert len(q.ping()) == 2
        finally:
            again.stop()
    finally:
        sup.stop()
        for pid in pids:  # whatever the outcome, nothing of this test outlives it
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_serve_whose_http_listener_cannot_start_starts_no_shard_and_releases_the_data_dir():
    """The HTTP listener is bound before the shards start: a port already taken ends
    `shardq serve` before any shard is spawned, and the next serve on the data dir starts
    (issue 44, item 9: it used to start the shards, say ready, then stop them)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    tmp = short_tmpdir()
    data = os.path.join(tmp, "data")
    cfg = os.path.join(tmp, "shardq.toml")
    with open(cfg, "w") as f:
        f.write(f'[http]\nlisten = "127.0.0.1:{port}"\n')
    try:
        rc, out = serve(data, 2, cfg)
        assert rc == 5 and "event=spawn" not in out, out[-3000:]  # a setup error, before any shard started
        assert re.search(r"^error: InvalidConfig: http.listen .*Address already in use", out, re.M), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        wait_until(lambda: no_process_uses(data), 10, what="no shard left running")
        with Service(data_dir=data) as svc:
            assert len(svc.shard_pids()) == 2
    finally:
        taken.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("inject", [_dup_schedule, _bad_schedule_module], ids=["two-of-a-name", "no-such-module"])
def test_a_schedule_mistake_is_refused_before_any_shard_starts(monkeypatch, inject):
    """Two schedules of one name were found once the shards were up (they were stopped
    again): the schedules are now collected before the first spawn."""
    from shardq.service.supervisor import Supervisor
    tmp = short_tmpdir()
    try:
        config, error, words = inject(monkeypatch, tmp)
        def spawn(self, h):
            raise AssertionError(f"shard {h.index} was spawned")
        monkeypatch.setattr(Supervisor, "_spawn", spawn)
        with pytest.raises(error, match=words):
            Supervisor(os.path.join(tmp, "data"), config, 2).start(background=True, start_timeout=30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
