"""Signals to a real ``shardq serve``: SIGTERM under load (a clean exit within the
documented bound, nothing acknowledged lost, a checkpoint on the way down) and SIGHUP (the
queue settings apply at once, every other change is named as needing a restart); and the
pure sorting of a reload's changes (:mod:`shardq.service.reload`)."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time

import pytest

import shardq
from support.service import Service, restarted, wait_until
from shardq.config import parse
from shardq.service.reload import SECRET, plan
from shardq.service.supervisor import STOP_GRACE_S

#: docs/operations.md, "Signals": serve exits within this long of SIGTERM
STOP_BOUND_S = STOP_GRACE_S + 5


def _records_in(segment: str) -> int:
    """How many records of operations a segment holds, sync marks left out
    (shardq/wal/format.py: the magic, then records, then the preallocated zeros)."""
    from shardq.wal.format import HEADER, HEADER_BYTES, MAGIC_BYTES, MARK_PAYLOAD
    with open(segment, "rb") as f:
        data = f.read()
    n, off = 0, MAGIC_BYTES
    while off + HEADER_BYTES <= len(data) and (length := HEADER.unpack_from(data, off)[1]):
        n += data[off + HEADER_BYTES:off + HEADER_BYTES + length] != MARK_PAYLOAD
        off += HEADER_BYTES + length
    return n


def _log(svc: Service) -> str:
    with open(svc.log_path, "rb") as f:
        return f.read().decode(errors="replace")


# ---------------------------------------------------------------------- SIGTERM
def test_sigterm_under_load_exits_0_in_bound_keeps_every_acknowledged_job_and_checkpoints():
    svc = Service(shards=2)
    with svc:
        enqueued: list[int] = []     # acknowledged enqueues
        settled: set[int] = set()    # leased jobs whose ack was sent (done, or maybe done)
        stop = threading.Event()

        def producer(n: int) -> None:
            with svc.connect(retry_s=0.5, request_timeout_s=5) as q:
                i = 0
                while not stop.is_set():
                    try:
                        # half to a queue nobody leases from: the checkpoint holds jobs
                        enqueued.append(q.enqueue(f"p{n}-{i}".encode().ljust(2048), key=f"k{n}-{i % 40}",
                                                  queue="backlog" if i % 2 else "default"))
                    except Exception:  # noqa: BLE001 - the service went away: this producer is done
                        return
                    i += 1

        def worker() -> None:
            with svc.connect(retry_s=0.5, request_timeout_s=5) as q:
                while not stop.is_set():
                    try:
                        leases = q.dequeue_many(max_jobs=20)
                        settled.update(lease.job_id for lease in leases)
                        if leases:
                            q.ack_many(leases)
                    except Exception:  # noqa: BLE001 - the service went away
                        return

        threads = [threading.Thread(target=producer, args=(n,)) for n in range(3)]
        threads += [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            # past the 1 MiB a shard must have logged to checkpoint on the way down (2 KiB bodies)
            wait_until(lambda: len(enqueued) >= 2000 and len(settled) >= 300, 60, 0.05, "load")
            signalled_at = time.time()
            began = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            rc = svc.proc.wait(STOP_BOUND_S + 10)
            took = time.monotonic() - began
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        print(f"serve stopped in {took:.2f} s under load ({len(enqueued)} enqueues acknowledged)")
        assert rc == 0, svc.tail()
        assert took < STOP_BOUND_S
        log = _log(svc)
        assert "event=stopping signal=SIGTERM" in log and "event=stopped" in log
        assert "SIGKILL" not in log  # every shard stopped by itself, none at the grace's end

        # a checkpoint written on the way down, and after it one segment with no record in
        # it: the next start replays the checkpoint and nothing else
        for i in range(2):
            shard_dir = os.path.join(svc.data_dir, f"shard-{i}")
            ckpts = glob.glob(os.path.join(shard_dir, "*.ckpt"))
            assert len(ckpts) == 1 and os.stat(ckpts[0]).st_mtime >= signalled_at - 0.05, ckpts
            base = os.path.basename(ckpts[0]).split(".")[0]
            segments = glob.glob(os.path.join(shard_dir, "*.wal"))
            assert [os.path.basename(p).split(".")[0] for p in segments] == [base]
            assert _records_in(segments[0]) == 0
            assert f"shard {i} compacted" in log

        svc.log.close()
        svc.start()  # the same data dir
        with svc.connect() as q:
            missing = []
            for job_id in set(enqueued) - settled:
                try:
                    q.job(job_id)
                except shardq.NotFound:
                    missing.append(job_id)
        assert not missing, f"{len(missing)} acknowledged jobs lost, e.g. {missing[:5]}"


# ---------------------------------------------------------------------- SIGHUP
def _toml(cfg: dict) -> str:
    from support.service import _to_toml
    return _to_toml(cfg)


def test_sighup_applies_the_queue_settings_and_names_what_needs_a_restart():
    base = {"service": {"health_timeout": 2}, "http": {"listen": ""}}
    svc = Service(shards=2, config=base)
    with svc:
        cfg_path = svc.data_dir.rstrip("/") + ".toml"
        with svc.connect() as q:
            assert q.queue_config("default")["visibility_timeout"] == 30
        new = {"service": {"health_timeout": 3, "restart_backoff_max": 30},
               "limits": {"segment_bytes": 8 * 1024 * 1024},
               "queue_defaults": {"visibility_timeout": 7},
               "queues": {"default": {"max_deliveries": 1}, "emails": {"dedup_window": 5}},
               "http": {"listen": ""}}
        with open(cfg_path, "w") as f:
            f.write(_toml(new))
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: _log(svc).count("event=shard-reloaded") == 2, 20, 0.02, "both shards reloaded")
        log = _log(svc)
        applied = dict(re.findall(r"event=reload-applied key=(\S+) old=\S+ new=(\S+)", log))
        restart = dict(re.findall(r"event=reload-needs-restart key=(\S+) old=\S+ new=(\S+)", log))
        assert applied == {"queue_defaults.visibility_timeout": "7.0", "queues.default.visibility_timeout": "7.0",
                           "queues.default.max_deliveries": "1", "queues.emails": '"declared"',
                           "service.restart_backoff_max": "30.0"}, log
        assert restart == {"service.health_timeout": "3.0", "limits.segment_bytes": "8388608"}, log
        assert "event=reloaded applied=5 needs_restart=2 shards_told=2" in log
        assert svc.proc.poll() is None  # SIGHUP no longer ends the process

        with svc.connect() as q:  # a new client: settings are cached per client
            assert q.queue_config("default")["visibility_timeout"] == 7
            assert q.queue_config("emails")["dedup_window"] == 5
            q.enqueue(b"once", key="a")
            lease = q.dequeue()
            assert lease is not None and 5 < lease.deadline - time.time() <= 7.5  # the new lease length
            q.nack(lease, error="boom")  # max_deliveries 1: dead at once
            assert [d.job_id for d in q.dead_letters()] == [lease.job_id]
            pid0 = svc.shard_pids()[0]

        # a shard restarted after the reload starts with the settings in force
        os.kill(pid0, signal.SIGKILL)
        restarted(svc, 0, pid0)
        with svc.connect() as q:
            assert q.queue_config("default")["visibility_timeout"] == 7  # answered by shard 0

        # a config that does not parse changes nothing
        with open(cfg_path, "w") as f:
            f.write("[queue_defaults]\nvisibility_timeout = -1\n")
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: "event=reload-failed" in _log(svc), 20, 0.02, "the reload refused")
        assert "queue_defaults.visibility_timeout" in _log(svc).split("event=reload-failed", 1)[1].split("\n")[0]
        with svc.connect() as q:
            assert q.queue_config("default")["visibility_timeout"] == 7
        assert svc.proc.poll() is None


def test_sighup_names_each_key_it_does_not_apply_and_why_and_leaves_it_as_it_was():
    """Issue 44, item 10: a new queue with limits, a changed limit and a new schedule wait
    for a restart: each is logged with why, the summary line names them all, and the
    service goes on as before (docs/operations.md, "Reloading")."""
    from shardq.service.reload import WHY_LIMIT, WHY_PLACED, WHY_TABLE
    base = {"service": {"health_timeout": 2}, "http": {"listen": ""},
            "queues": {"default": {}, "paced": {"concurrency": 1}}}
    with Service(shards=1, config=base) as svc:
        new = {**base, "queues": {"default": {}, "paced": {"concurrency": 3}, "reports": {"concurrency": 2},
                                  "emails": {}},
               "schedules": {"nightly": {"every_s": 3600, "body": "tick"}}}
        with open(svc.data_dir.rstrip("/") + ".toml", "w") as f:
            f.write(_toml(new))
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: "event=reloaded" in _log(svc), 20, 0.02, "the reload")
        log = _log(svc)
        why = {k: json.loads(w) for k, w in re.findall(r'event=reload-needs-restart key=(\S+) .* why=("[^"]*")', log)}
        assert why == {"queues.paced.concurrency": WHY_LIMIT, "queues.reports": WHY_PLACED,
                       "schedules.nightly": WHY_TABLE["schedules"]}, log
        assert ('event=reloaded applied=1 needs_restart=3 shards_told=1 '
                'not_applied="queues.paced.concurrency queues.reports schedules.nightly"') in log, log
        assert "event=scheduler-started" not in log
        with svc.connect() as q:
            assert q.queue_config("paced")["concurrency"] == 1
            assert "concurrency" not in q.queue_config("reports") and q.queue_config("reports")["shard"] is None
        assert svc.proc.poll() is None


def test_sighup_refuses_a_new_shard_count_as_no_restart_could_take_it():
    """A new service.shards was logged as waiting for a restart, and the restart then
    failed (ShardCountMismatch, exit 5): it is refused, at ERROR, and named as such."""
    base = {"service": {"health_timeout": 2}, "http": {"listen": ""}}
    with Service(shards=1, config=base) as svc:
        with open(svc.data_dir.rstrip("/") + ".toml", "w") as f:
            f.write(_toml({**base, "service": {"health_timeout": 2, "shards": 3}}))
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: "event=reloaded" in _log(svc), 20, 0.02, "the reload")
        log = _log(svc)
        refused = r"ERROR event=reload-refused key=service\.shards old=\S+ new=3 why=.*ShardCountMismatch"
        assert re.search(refused, log), log
        assert "event=reload-needs-restart key=service.shards" not in log
        assert 'event=reloaded applied=0 needs_restart=0 shards_told=0 not_applied="service.shards" ' \
               'refused="service.shards"' in log, log
        assert svc.proc.poll() is None


def test_the_reload_table_of_the_docs_is_the_one_the_code_applies():
    """docs/operations.md lists exactly the queue keys a reload applies and the limits it leaves."""
    import dataclasses
    from shardq.config import LIMIT_KEYS, QueueConfig
    from shardq.service.reload import APPLIED_KEYS, WHY_TABLE
    from support.service import REPO
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        rows = [line for line in f if line.startswith("| ") and line.rstrip().endswith(("| applied at once |",
                                                                                         "| restart |"))
                or line.startswith("| a queue's limits:")]
    cells = {r.split(" | ")[0][2:]: r.split(" | ")[1].strip(" |\n") for r in rows}
    applied_queue_keys = [k for k in cells if k.startswith("`[queue_defaults]`")]
    assert re.findall(r"`(\w+)`", applied_queue_keys[0].split(":", 1)[1]) == [
        f.name for f in dataclasses.fields(QueueConfig) if f.name not in LIMIT_KEYS]
    limit_row = next(k for k in cells if k.startswith("a queue's limits"))
    assert re.findall(r"`(\w+)`", limit_row) == list(LIMIT_KEYS) and cells[limit_row].startswith("restart")
    assert [f"`{k}`" for k in APPLIED_KEYS] == [k for k, v in cells.items() if v == "applied at once"
                                                and k.startswith("`service.")]
    for table in WHY_TABLE:
        assert any(k.startswith(f"`[{table}") for k, v in cells.items() if v.startswith("restart")), table


# ---------------------------------------------------------------------- the plan, pure
def test_a_reload_plan_sorts_each_change_and_keeps_the_rest_in_force():
    old = parse({"queues": {"default": {}, "gone": {}, "a.b": {"max_deliveries": 2}}})
    new = parse({"service": {"shards": 4, "restart_backoff_max": 5},
                 "queue_defaults": {"lease_sync": "strict"},
                 "queues": {"default": {"visibility_timeout": 9}, "a.b": {"max_deliveries": 3}, "fresh": {}},
                 "http": {"token": "t" * 20}})
    p = plan(old, new)
    assert {c.key for c in p.applied} == {
        "service.restart_backoff_max", "queue_defaults.lease_sync", "queues.default.visibility_timeout",
        "queues.default.lease_sync", 'queues."a.b".max_deliveries', 'queues."a.b".lease_sync',
        "queues.gone", "queues.fresh"}
    assert {c.key: (c.old, c.new) for c in p.restart} == {"service.shards": (0, 4), "http.token": ("", SECRET)}
    cfg = p.config
    assert cfg.service.shards == 0 and cfg.service.restart_backoff_max == 5 and cfg.http.token == ""
    assert set(cfg.queues) == {"default", "a.b", "fresh"} and cfg.queues["default"].visibility_timeout == 9
    assert cfg.queue_defaults.lease_sync == "strict"
    assert plan(cfg, cfg) == ([], [], cfg)


def test_a_reload_reports_each_changed_sqs_api_key_as_needing_a_restart():
    """[sqs_api] is left out of to_dict (the shards never read it): a SIGHUP that changed it
    used to report nothing. Each changed key waits for a restart, its secret never shown."""
    import dataclasses
    from shardq.service.reload import WHY_TABLE
    old = parse({"sqs_api": {"listen": "127.0.0.1:9324"}})
    new = parse({"sqs_api": {"listen": "0.0.0.0:9325", "region": "eu-west-1", "account_id": "123456789012",
                             "access_key_id": "AKIDEXAMPLE00000", "secret_access_key": "s3cr3t-value-0123456789"}})
    p = plan(old, new)
    assert p.applied == []
    assert {c.key: (c.old, c.new, c.why) for c in p.restart} == {
        "sqs_api.listen": ("127.0.0.1:9324", "0.0.0.0:9325", WHY_TABLE["sqs_api"]),
        "sqs_api.region": ("us-east-1", "eu-west-1", WHY_TABLE["sqs_api"]),
        "sqs_api.account_id": ("000000000000", "123456789012", WHY_TABLE["sqs_api"]),
        "sqs_api.access_key_id": ("", "AKIDEXAMPLE00000", WHY_TABLE["sqs_api"]),
        "sqs_api.secret_access_key": ("", SECRET, WHY_TABLE["sqs_api"])}
    assert "s3cr3t-value-0123456789" not in repr(p.restart)
    assert p.config.sqs_api == old.sqs_api  # nothing of it in force before the restart
    rotated = parse({"sqs_api": dict(dataclasses.asdict(new.sqs_api), secret_access_key="another-secret-0123456789")})
    assert [(c.key, c.old, c.new) for c in plan(new, rotated).restart] == [
        ("sqs_api.secret_access_key", SECRET, SECRET)]


def test_a_reload_leaves_exact_limits_to_a_restart():
    """A queue's limits (docs/limits.md) place its jobs on one shard: a reload keeps them,
    and a queue that declares one neither comes nor goes."""
    old = parse({"queues": {"default": {}, "paced": {"concurrency": 2}, "old": {"rate": "5/s"}}})
    new = parse({"queues": {"default": {}, "paced": {"concurrency": 3, "max_deliveries": 9},
                            "placed": {"concurrency": 1}}})
    p = plan(old, new)
    assert [c.key for c in p.applied] == ["queues.paced.max_deliveries"]
    assert sorted(c.key for c in p.restart) == ["queues.old", "queues.paced.concurrency", "queues.placed"]
    assert p.config.queues["paced"].concurrency == 2 and p.config.queues["paced"].max_deliveries == 9
    assert set(p.config.queues) == {"default", "paced", "old"}


@pytest.mark.parametrize("bad", [{"queue_defaults": {"visibility_timeout": 0}}, {"nonsense": {}}])
def test_reloading_an_invalid_config_raises_before_anything_changes(bad):
    from shardq.errors import InvalidConfig
    from shardq.service.supervisor import Supervisor
    sup = Supervisor("/tmp/never-started", {})
    with pytest.raises(InvalidConfig):
        sup.reload(bad)
    assert sup.config.queue_defaults.visibility_timeout == 30
