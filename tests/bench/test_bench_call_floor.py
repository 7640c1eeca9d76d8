"""bench/probes/call_floor.py runs end to end in quick mode: every floor reply matched its request,
shardq took every call through bench.run's adapter, and CPU (with its user/system split and
the servers' blocking waits) was read for both sides. No timing is asserted."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from support.service import REPO


def with_shardq(tmp_path, *args):
    """A quick run of the floor and shardq with ``args``: its JSON, the completed process,
    and what it left in its log directory."""
    out = tmp_path / "floor.json"
    logs = tempfile.mkdtemp(prefix="sqf-")  # short: shardq's unix sockets live under it
    try:
        r = subprocess.run([sys.executable, "-m", "bench.probes.call_floor", "--quick", "--peers", "shardq", *args,
                            "--dir", logs, "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
        left = [p for p in os.listdir(logs) if p.startswith("sq-floor-")]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text()), r, left


def test_call_floor_benchmark_runs(tmp_path):
    res, r, left = with_shardq(tmp_path)
    assert res["ok"] is True and res["calls"] == 300 and res["skipped"] == {}
    for name in ("floor", "shardq"):
        (run,) = res["runs"][name]
        assert run["ok"] is True and run["calls"] == 300
        # both sides did work for every call: a server that answered without reading, or a
        # shard that was never reached, would show no CPU
        assert run["us_per_call"] > 0 and run["client_cpu_us"] > 0 and run["server_cpu_us"] > 0
        # the split adds up to the whole, and a server that answers 300 calls waits for most
        # of them (in epoll or a read; shardq's shards also in fdatasync)
        assert abs(run["server_user_us"] + run["server_sys_us"] - run["server_cpu_us"]) < 1e-6
        assert run["server_user_us"] >= 0 and run["server_sys_us"] >= 0
        assert run["server_blocks"] >= 0.5
    assert "above the floor" in r.stdout
    assert left == []  # each run's directory removed


def test_call_floor_times_a_lease_and_its_ack(tmp_path):
    # --op lease-ack: the peer's jobs are enqueued first and each timed call leases one and
    # acks it; ok only if every call leased a job with the body sent (an empty queue, or a
    # dequeue that came back with nothing, fails the run)
    res, r, _ = with_shardq(tmp_path, "--op", "lease-ack")
    assert res["ok"] is True and res["op"] == "lease-ack"
    for name in ("floor", "shardq"):
        (run,) = res["runs"][name]
        assert run["ok"] is True and run["calls"] == 300 and run["server_cpu_us"] > 0
    assert "(lease-ack)" in r.stdout


def test_a_peer_call_that_leases_nothing_fails_the_run(tmp_path):
    from bench.probes import call_floor

    class Empty:  # a peer whose queue never has a job: every lease comes back empty
        batch_mode = None

        def __init__(self, **_):
            self.enqueued = 0

        def setup(self, directory):
            pass

        def server_pids(self):
            return []

        def enqueue(self, body, key):
            self.enqueued += 1

        def dequeue(self, wait_s):
            return None

        def teardown(self):
            pass

    call_floor.PEERS["empty"] = Empty
    try:
        res = call_floor.peer_run("empty", 5, str(tmp_path), op="lease-ack")
    finally:
        del call_floor.PEERS["empty"]
    assert res["ok"] is False and res["calls"] == 5


def floor_only(tmp_path, *args):
    """A quick run of the floor alone with ``args``; its JSON and the completed process."""
    out = tmp_path / "floor.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.call_floor", "--quick", "--peers", "", *args,
                        "--dir", str(tmp_path), "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text()), r


def test_call_floor_pins_client_and_server_when_asked(tmp_path):
    res, r = floor_only(tmp_path, "--cpus", "same")
    assert res["ok"] is True and res["cpus"] == "same" and list(res["runs"]) == ["floor"]
    assert "CPUs: same" in r.stdout


def test_call_floor_refuses_a_placement_this_process_cannot_use(tmp_path):
    # taskset-like: run it allowed on CPU 0 only; "apart" needs CPU 1 too
    code = ("import os, sys; os.sched_setaffinity(0, {0}); sys.argv = ['call_floor', '--quick', '--cpus', "
            "'apart', '--peers', '']; import runpy; runpy.run_module('bench.probes.call_floor', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpus apart needs CPUs [0, 1]" in r.stderr


def test_call_floor_pauses_between_calls_when_asked(tmp_path):
    res, r = floor_only(tmp_path, "--gap-ms", "1")
    (run,) = res["runs"]["floor"]
    assert res["ok"] is True and res["gap_ms"] == 1 and run["ok"] is True and run["us_p50"] > 0
    assert "gap: 1 ms" in r.stdout


def test_the_pause_after_each_call_is_not_timed(monkeypatch):
    from bench.probes import call_floor
    now = [0.0]
    slept = []

    def call(i):
        now[0] += 0.005  # each call takes 5 ms on this clock
        return i != 2

    def sleep(s):
        slept.append(s)
        now[0] += s
    monkeypatch.setattr(call_floor.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(call_floor.time, "sleep", sleep)
    ok, took = call_floor.timed_calls(call, 4, 0.25)
    assert ok == 3 and slept == [0.25] * 4
    assert [round(t, 9) for t in took] == [0.005] * 4


def test_call_floor_refuses_a_gap_out_of_range(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.probes.call_floor", "--quick", "--peers", "", "--gap-ms", "-1"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--gap-ms -1.0 is outside 0..1000" in r.stderr


def test_call_floor_runs_shardq_on_the_shards_asked_for(tmp_path):
    res, _, _ = with_shardq(tmp_path, "--shardq-shards", "1")
    (run,) = res["runs"]["shardq"]
    assert res["shardq_shards"] == 1 and run["servers"] == 1 and run["ok"] is True


def test_call_floor_refuses_a_shard_count_out_of_range():
    r = subprocess.run([sys.executable, "-m", "bench.probes.call_floor", "--quick", "--peers", "",
                        "--shardq-shards", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--shardq-shards 0 is outside 1..64" in r.stderr


def test_server_blocks_count_every_thread():
    """A server's waits may be on any of its threads (a shard's committer fsyncs on its
    own): the count sums them all, where the main thread's alone would miss them."""
    import psutil
    from bench.probes.call_floor import server_usage
    code = ("import sys, threading, time\n"
            "def work():\n"
            "    for _ in range(50):\n"
            "        time.sleep(0.001)\n"
            "    print('slept', flush=True)\n"
            "    threading.Event().wait()\n"
            "threading.Thread(target=work, daemon=True).start()\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "slept\n"  # the thread blocked 50 times and lives on
        proc = psutil.Process(child.pid)
        usage = server_usage([proc])
        assert usage.blocks >= 50
        assert proc.num_ctx_switches().voluntary < 50  # the main thread's own count
        assert usage.run_s > 0 and usage.user_s >= 0 and usage.system_s >= 0
    finally:
        child.kill()
        child.wait()


def test_call_floor_hands_the_busy_poll_budget_to_shardq(tmp_path, monkeypatch):
    # the adapter gets --shardq-busy-poll-us (which it passes to the router and the shards,
    # tests/bench/test_bench_quick.py); the run records it
    from bench.probes import call_floor
    made = []

    class Recording(call_floor.PEERS["shardq"]):
        def __init__(self, **kw):
            made.append(kw)
            super().__init__(**kw)

    monkeypatch.setitem(call_floor.PEERS, "shardq", Recording)
    logs = tempfile.mkdtemp(prefix="sqf-")  # short: shardq's unix sockets live under it
    try:
        res = call_floor.peer_run("shardq", 20, logs, shardq_busy_poll_us=0)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    assert res["ok"] is True and made == [{"shards": None, "busy_poll_us": 0}]
    res, _, _ = with_shardq(tmp_path, "--shardq-busy-poll-us", "0")
    assert res["shardq_busy_poll_us"] == 0 and res["runs"]["shardq"][0]["ok"] is True


def test_server_cpu_is_read_in_nanoseconds_not_clock_ticks():
    """The floor's server spends about 30 µs on each of --quick's 300 calls: 9 ms, less than
    one 10 ms tick of /proc's stat, so a measurement in ticks could read 0 for it. The
    schedstat time of a process that ran 2 ms reads 2 ms, and its split adds up to it."""
    import psutil
    from bench.probes.call_floor import cpu_split, server_usage
    code = ("import sys, time\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "t = time.thread_time()\n"
            "while time.thread_time() - t < 0.002:\n"
            "    pass\n"
            "print('spun', flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"  # started: its start-up is not measured
        proc = psutil.Process(child.pid)
        before = server_usage([proc])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spun\n"
        after = server_usage([proc])
        user, system = cpu_split(before, after)
        assert 0.002 <= after.run_s - before.run_s < 1.0
        assert user >= 0 and system >= 0 and abs(user + system - (after.run_s - before.run_s)) < 1e-9
    finally:
        child.kill()
        child.wait()


def test_the_cpu_split_follows_the_ticks_and_falls_back_on_all_of_them():
    from bench.probes.call_floor import Usage, cpu_split
    # ticks in the window: 1 user to 3 system
    assert cpu_split(Usage(1.0, 0.5, 0.5, 0), Usage(1.4, 0.51, 0.53, 0)) == pytest.approx((0.1, 0.3))
    # no tick in the window: the proportion of all the ticks so far
    assert cpu_split(Usage(1.0, 0.3, 0.1, 0), Usage(1.004, 0.3, 0.1, 0)) == pytest.approx((0.003, 0.001))
    # no tick ever: all user time, as the kernel splits it
    assert cpu_split(Usage(0.0, 0.0, 0.0, 0), Usage(0.004, 0.0, 0.0, 0)) == pytest.approx((0.004, 0.0))
