"""The benchmark harness runs end to end in quick mode and every job is delivered (or run)
exactly once in effect. No timing is asserted: speed belongs in docs/performance.md.

Figure Wk's framework rows run where their packages and redis-server are installed
(``pip install -e '.[bench]'``, ``bash bench/setup_peers.sh redis``); elsewhere the harness
reports them skipped as not installed, and that is the only skip accepted here.
"""
import errno
import json
import os
import socket
import subprocess
import sys

from bench import report, targets
from support.service import poll_until
from bench.mpmc import phases
from bench import run as bench_run_module
from bench.workers.record import RecordReader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One row per framework, at the durability equal to shardq's (and Huey on SQLite): the
# redis-default rows run the same code against a different server setting.
WK_ROWS = ("shardq,shardq-idem,celery@redis-always,dramatiq@redis-always,rq@redis-always,"
           "rq-simple@redis-always,huey@redis-always,huey@sqlite")
NOT_INSTALLED = ("not installed", "not on PATH")


def bench_run(tmp_path, *args, timeout=300):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--no-install", "--json", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["ok"] is True
    return results, proc.stdout


def test_quick_benchmark_runs_and_delivers_every_job_once(tmp_path):
    results, text = bench_run(tmp_path, "--only", "shardq", "--figures",
                              "A,C,B,C2,B-threads,D,D2,M,L,W")
    figures = results["peers"]["shardq"]["figures"]
    drained = {name: f["summary"] for name, f in figures.items() if "exactly_once" in f["summary"]}
    assert {"C", "C2", "D", "D2", "M", "W"} <= set(drained), sorted(figures)
    for name, summary in drained.items():
        assert summary["exactly_once"] is True, (name, summary)
        assert summary["missing"] == 0 and summary["duplicates"] == 0, (name, summary)
    m = figures["M"]["runs"][0]
    assert (m["producers"], m["consumers"], m["mode"]) == (16, 4, "processes")
    for name in ("D", "D2", "M"):  # the run in two phases: producers running, then consumers alone
        run = figures[name]["runs"][0]
        assert 0 < run["produce_s"], (name, run)
        if run["produce_s"] > run["seconds"]:
            # The consumers acked the last job before its producer's call had returned
            # (seen with 500 jobs at 100 per call): every ack fell while producing.
            assert run["acked_while_producing"] == run["jobs"], (name, run)
        assert run["enqueue_per_s"] == run["jobs"] / run["produce_s"], (name, run)
        assert 0 <= run["acked_while_producing"] <= run["jobs"], (name, run)
        if run["acked_while_producing"] < run["jobs"]:
            assert run["drain_after_per_s"] > 0, (name, run)
        assert figures[name]["summary"]["enqueue_per_s"] == run["enqueue_per_s"], name
    for name, key in (("L@500", "latency_cdf_us"), ("W", "wake_cdf_us")):  # bench.plot's latency.png
        cdf = figures[name]["runs"][0][key]
        assert cdf and cdf == sorted(cdf) and cdf[0] > 0, (name, cdf[:5])
    assert "M  after the producers: drain [jobs/s]" in text
    assert not results["wk"]  # Wk not chosen: not run
    # shardq as the default config runs it on this machine, and the run says how many shards
    from shardq.config import parse
    assert results["meta"]["shardq_shards"] == parse({}).resolved_shards()


def test_a_benchmark_stopped_by_sigterm_stops_the_servers_it_started(tmp_path):
    """A long benchmark stopped with SIGTERM died at once, skipping every adapter's teardown:
    its data directories stayed, and so would a peer's server (beanstalkd, redis-server: the
    shards at least exit with their embedded supervisor). It now unwinds through them."""
    import shutil
    import signal
    import tempfile
    import time
    import psutil
    where = tempfile.mkdtemp(prefix="sqb", dir="/tmp")  # unix socket paths must stay short
    # --quick for its 0.2 s physical limits (1 s each otherwise, before any shard starts);
    # --jobs 10000, so figure M is still long when the SIGTERM comes.
    proc = subprocess.Popen([sys.executable, "-m", "bench.run", "--quick", "--jobs", "10000", "--runs", "1",
                             "--no-install", "--only", "shardq", "--figures", "M", "--no-scaling",
                             "--json", str(tmp_path / "r.json"), "--tmpdir", where],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def servers() -> list:
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = p.info["cmdline"] or ()
                if p.pid != proc.pid and any(where in part for part in cmd) and "shardq.shard.process" in cmd:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    try:
        poll_until(lambda: servers() or proc.poll() is not None, time.monotonic() + 120, 0.1)
        shards = servers()
        assert shards, ("the benchmark never started a shard", proc.poll() is None or proc.stderr.read()[-2000:])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
        _, alive = psutil.wait_procs(shards, timeout=20)
        assert not alive and not servers(), [p.pid for p in alive]
        assert os.listdir(where) == []  # every data directory removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)


def test_worker_runners_run_every_job_once(tmp_path):
    results, text = bench_run(tmp_path, "--only", "shardq", "--figures", "Wk",
                              "--wk-jobs", "40", "--runners", WK_ROWS)
    rows = results["wk"]
    assert set(rows) == set(WK_ROWS.replace("shardq,shardq-idem", "shardq@shardq,"
                                            "shardq-idem@shardq").split(","))
    assert results["peers"] == {}  # no per-peer figure chosen
    for name, row in rows.items():
        if row["status"] == "skipped":
            assert not name.startswith("shardq"), (name, row["reason"])
            assert any(why in row["reason"] for why in NOT_INSTALLED), (name, row["reason"])
            continue
        (run,) = row["runs"]
        assert "error" not in run, (name, run)
        assert run["stopped"] is None, (name, run)
        d = run["delivery"]
        assert (d["expected"], d["delivered"], d["missing"], d["duplicates"]) == (40, 40, 0, 0), \
            (name, d)
        assert run["enqueue_per_s"] > 0 and run["jobs_per_s"] > 0, (name, run)
        assert row["summary"]["exactly_once"] is True, name
    assert "fsync" in rows["shardq@shardq"]["durability"]
    assert "Wk >= 2x the fastest runner on Redis always" in text


def test_shardq_rows_run_while_a_service_holds_the_default_http_port(tmp_path, monkeypatch):
    # A user who started the service (README's first command) and then runs the benchmark:
    # the runner's own `shardq serve` must not try the port the user's service holds, the
    # default one or one the user's shell names in SHARDQ_HTTP_LISTEN (which beats a config).
    from shardq import config as shardq_config
    host, port = shardq_config.split_listen(shardq_config.load(
        os.path.join(REPO, "config", "shardq.toml")).http.listen)
    holder = socket.socket()
    try:
        holder.bind((host, port))
        holder.listen(1)
    except OSError as e:
        assert e.errno == errno.EADDRINUSE, e  # held already: the case under test
    monkeypatch.setenv("SHARDQ_HTTP_LISTEN", f"{host}:{port}")
    try:
        results, text = bench_run(tmp_path, "--only", "shardq", "--figures", "Wk",
                                  "--wk-jobs", "20", "--runners", "shardq,shardq-idem")
    finally:
        holder.close()
    for name in ("shardq@shardq", "shardq-idem@shardq"):
        row = results["wk"][name]
        assert row["status"] == "ok", (name, row.get("reason"))
        assert row["summary"]["exactly_once"] is True, (name, row["runs"])


def test_shardq_skipped_fails_the_run_and_a_peer_skipped_does_not():
    ok_summary = {"errors": 0, "exactly_once": True}
    def results(shardq_status, redis_status):
        return {"peers": {
            "shardq": {"status": shardq_status, "figures": {"A": {"summary": ok_summary}}},
            "redis": {"status": redis_status, "figures": {}}},
            "wk": {"shardq@shardq": {"status": "ok", "summary": ok_summary}}}
    assert bench_run_module.exit_status(results("ok", "skipped")) == 0
    assert bench_run_module.exit_status(results("skipped", "ok")) == 1
    wk_skipped = results("ok", "ok")
    wk_skipped["wk"]["shardq-idem@shardq"] = {"status": "skipped", "reason": "serve exited"}
    assert bench_run_module.exit_status(wk_skipped) == 1


def test_wk_table_shows_a_row_whose_only_run_failed_before_it_started():
    rows = {"shardq@shardq": {"status": "ok", "runner": "shardq", "command": "shardq worker",
                              "durability": None, "fsync_probe_per_s": [3000.0],
                              "runs": [{"error": "RuntimeError: enqueue exited with 1"}]}}
    rows["shardq@shardq"]["summary"] = report.summarize("Wk", rows["shardq@shardq"]["runs"])
    text = report.wk_table(rows)
    assert "shardq@shardq" in text and "error" in text, text


def _results(shardq_a: float, redis_a: float, fsync: float, rtt: float) -> dict:
    def peer(a):
        return {"status": "ok", "figures": {"A": {"summary": {"jobs_per_s": a}}}}
    return {"peers": {"shardq": peer(shardq_a), "redis": peer(redis_a)},
            "physical": {"fsync_per_s": fsync, "pipe_rtt_per_s": rtt}, "wk": {}}


def test_targets_say_met_missed_and_not_measured():
    # 1/(1/5000 + 1/20000) = 4000/s: A at 3000 is 0.75 of it, below the 0.85 target.
    verdicts = {label: verdict for label, _shown, verdict in
                targets.rows(_results(3000, 2500, 5000, 20000))}
    assert verdicts["A >= 1.0x Redis"] == "met"
    assert verdicts["A >= 0.85 of 1/(fsync + pipe round trip)"] == "MISSED by 12%"
    assert verdicts["A >= 0.9x beanstalkd"].startswith("not measured")
    assert verdicts["M >= 1.5x the best peer"].startswith("not measured")
    verdicts = {label: verdict for label, _shown, verdict in
                targets.rows(_results(3400, 4000, 5000, 20000))}
    assert verdicts["A >= 1.0x Redis"] == "MISSED by 15%"
    assert verdicts["A >= 0.85 of 1/(fsync + pipe round trip)"] == "met"


def test_the_limits_count_a_leases_fsync_only_for_strict_leases():
    physical = {"fsync_per_s": 2000, "pipe_rtt_per_s": 20000, "pipe_pipelined_msgs_per_s": 200000,
                "pipe_batched_jobs_per_s": 1000000}
    results = {"peers": {"shardq": {"status": "ok", "figures": {
                   "C": {"summary": {"jobs_per_s": 1000}}, "M": {"summary": {"jobs_per_s": 1000}}}}},
               "physical": physical, "physical_runs": [physical]}
    batched = report.limits_text({**results, "meta": {"shardq_lease_sync": "batched"}})
    assert "C 1,000 jobs/s = 50% of fsync_per_s (lease + ack, batched leases: 1 fsync/job)" in " ".join(batched.split())
    assert ("M 1,000 jobs/s = 100% of fsync_per_s (enqueue + lease + ack, batched leases: 2 fsyncs/job"
            in " ".join(batched.split()))
    strict = report.limits_text({**results, "meta": {"shardq_lease_sync": "strict"}})
    assert "C 1,000 jobs/s = 100% of fsync_per_s (lease + ack, strict leases: 2 fsyncs/job)" in " ".join(strict.split())
    assert "150% of fsync_per_s (enqueue + lease + ack, strict leases: 3 fsyncs/job" in strict


def test_wk_target_compares_with_the_fastest_runner_at_that_durability():
    def row(broker, rate):
        return {"broker": broker, "status": "ok", "summary": {"jobs_per_s": rate}}
    results = {"peers": {}, "physical": {}, "wk": {
        "shardq@shardq": row("shardq", 3000), "celery@redis-always": row("redis-always", 1000),
        "huey@redis-always": row("redis-always", 1600), "huey@redis-default": row("redis-default", 2000),
        "huey@sqlite": row("sqlite", 9000)}}
    got = {label: (shown, verdict) for label, shown, verdict in targets.rows(results)}
    shown, verdict = got["Wk >= 2x the fastest runner on Redis always"]
    assert verdict == "MISSED by 6%" and "huey@redis-always" in shown  # 3000/1600 = 1.875
    shown, verdict = got["Wk >= 1x the fastest runner on Redis default"]
    assert verdict == "met" and shown.startswith("1.50x")


def test_record_reader_keeps_a_half_written_line_for_the_next_poll(tmp_path):
    path = tmp_path / "runs.log"
    reader = RecordReader(str(path))
    assert reader.poll() == 0  # no file yet
    path.write_bytes(b"a:1 100\nb:2 3")
    assert reader.poll() == 1 and reader.ids == ["a:1"]
    with open(path, "ab") as f:
        f.write(b"00\na:1 250\n")
    assert reader.poll() == 2
    assert reader.ids == ["a:1", "b:2", "a:1"]
    assert (reader.first_ns, reader.last_ns) == (100, 300)


def test_shards_default_to_the_default_configs_count_and_refuse_a_negative_count(capsys):
    from shardq.config import parse
    assert bench_run_module.parse_args([]).shards == parse({}).resolved_shards()
    assert bench_run_module.parse_args(["--shards", "3"]).shards == 3
    from bench.peers.shardq_peer import ShardqAdapter
    assert ShardqAdapter().shards == parse({}).resolved_shards() and ShardqAdapter(shards=3).shards == 3
    try:
        bench_run_module.parse_args(["--shards", "-1"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--shards -1 was accepted")
    assert "--shards -1" in capsys.readouterr().err


def test_a_many_client_run_is_split_where_the_last_producer_ends():
    # producers 0..2 s; acks of 5 and 3 jobs by then (one at the boundary), 2 after; end at 4 s
    got = phases(0.0, 2.0, 4.0, 10, [(1.0, 5), (2.0, 3), (3.5, 2)])
    assert got == {"produce_s": 2.0, "enqueue_per_s": 5.0, "acked_while_producing": 8,
                   "drain_after_per_s": 1.0}
    # every job acked while the producers ran: no drain phase to rate
    assert phases(0.0, 2.0, 2.0, 4, [(1.0, 4)])["drain_after_per_s"] is None


def test_busy_poll_us_reaches_every_shardq_router_of_a_run(monkeypatch):
    import shardq
    from bench.peers import shardq_peer

    opened = []
    monkeypatch.setattr(shardq, "connect", lambda target, **options: opened.append(options) or object())
    adapter = shardq_peer.ShardqAdapter(shards=1, busy_poll_us=0)
    adapter._data_dir, adapter._has_connect = "/nowhere", True
    spec = adapter.client_spec()
    getattr(shardq_peer, spec.factory)(**spec.kwargs)  # as a client process builds its client
    assert opened == [{"busy_poll_us": 0}]
    assert shardq_peer.ShardqAdapter(shards=1).options == {}  # the router's default
    args = bench_run_module.parse_args(["--busy-poll-us", "0", "--only", "shardq"])
    assert bench_run_module.make_adapter("shardq", args).options == {"busy_poll_us": 0}
