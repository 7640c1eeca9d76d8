"""Every limit at its maximum, through compaction, SIGKILL and restart (issue 9, item 1).

Whatever the reader refuses, the writer must never produce: bodies at ``max_body_bytes``
and at the ceiling, keys and dedup ids at their maxima, batches at ``BATCH_JOBS_MAX`` and
at the request size limit, many large requests in one loop iteration, and a checkpoint of
thousands of large jobs. After each, every acknowledged job comes back byte for byte.
"""
from __future__ import annotations

import hashlib
import os
import struct

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.datadir import DataDir
from shardq.shard.durable import Engine
from shardq.wal.format import RECORD_BYTES_MAX, SEGMENT, CHECKPOINT, checkpoint_name, segment_name
from shardq.wal.reader import FileScan

from conftest import config_from
from support.service import Service, short_tmpdir

MiB = 1024 * 1024
CEILING = limits.BODY_BYTES_MAX_CEILING


def body_of(i: int, size: int) -> bytes:
    """A body of exactly ``size`` bytes that differs per ``i`` (and is not all zeros)."""
    head = f"job-{i}:".encode()
    return (head + bytes([i % 251 + 1]) * size)[:size]


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def drain_all(q, queue: str, expected: int) -> dict:
    """job id -> (key, body digest) of every job in ``queue``, leased and acked."""
    got = {}
    while len(got) < expected:
        leases = q.dequeue_many(queue, max_jobs=10_000, wait=2.0, visibility=600)
        assert leases, f"only {len(got)} of {expected} jobs came back"
        for lease in leases:
            got[lease.job_id] = (lease.key, digest(lease.body))
        assert q.ack_many(leases) == [None] * len(leases)
    assert q.dequeue(queue) is None
    return got


def restart_after_sigkill(svc: Service) -> None:
    svc.kill_all()
    svc.log.close()
    svc.start(timeout=120)


def test_the_reported_workload_survives_compaction_and_restart():
    """2,600 pending jobs of 40 KiB, one shard, compact_min_bytes = 90,000,000: the
    checkpoint used to hold one 82 MB record the reader refused, so the shard never
    started again and every job on it was unreachable."""
    cfg = {"limits": {"compact_min_bytes": 90_000_000}}
    with Service(shards=1, config=cfg) as svc:
        want = {}
        with svc.connect() as q:
            for start in range(0, 2600, 200):
                jobs = [{"body": body_of(i, 40 * 1024), "key": f"user-{i % 97}"} for i in range(start, start + 200)]
                for jid, job in zip(q.enqueue_many(jobs), jobs):
                    want[jid] = (job["key"], digest(job["body"]))
            assert q.stats()["shards"][0]["compactions"] >= 1
        ckpt = [n for n in os.listdir(os.path.join(svc.data_dir, "shard-0")) if n.endswith(".ckpt")]
        assert ckpt, "the workload did not compact"
        restart_after_sigkill(svc)
        with svc.connect() as q:
            assert drain_all(q, "default", len(want)) == want


def test_bodies_keys_and_dedup_ids_at_their_maxima():
    cfg = {"limits": {"compact_min_bytes": 4096},
           "queues": {"default": {}, "huge": {"max_body_bytes": CEILING}}}
    key_max = "é" * (limits.KEY_BYTES_MAX // 2)          # 512 bytes of UTF-8, 256 characters
    dedup_max = "d" * limits.DEDUP_ID_BYTES_MAX
    with Service(shards=2, config=cfg) as svc:
        want: dict[str, dict] = {"default": {}, "huge": {}}
        with svc.connect() as q:
            for i in range(40):
                b = body_of(i, limits.BODY_BYTES_MAX_DEFAULT)
                jid = q.enqueue(b, key=key_max[:-1] + str(i % 10), dedup_id=f"{i:03d}" + dedup_max[3:])
                want["default"][jid] = (key_max[:-1] + str(i % 10), digest(b))
            for i in range(3):
                b = body_of(i, CEILING)
                jid = q.enqueue(b, key=key_max, queue="huge")
                want["huge"][jid] = (key_max, digest(b))
            # One past each limit is refused with a typed error, and adds nothing.
            refusals = [
                lambda: q.enqueue(b"x" * (limits.BODY_BYTES_MAX_DEFAULT + 1)),
                lambda: q.enqueue(b"x" * (CEILING + 1), queue="huge"),
                lambda: q.enqueue(b"x", key=key_max + "a"),
                lambda: q.enqueue(b"x", key="\ud800"),
                lambda: q.enqueue(b"x", dedup_id=dedup_max + "d"),
                lambda: q.enqueue(b"x", dedup_id="é" * (limits.DEDUP_ID_BYTES_MAX // 2 + 1)),
            ]
            for refuse in refusals:
                with pytest.raises(shardq.InvalidJob):
                    refuse()
            # The same dedup id at its maximum returns the first job.
            first = next(iter(want["default"]))
            assert q.enqueue(b"again", key=key_max[:-1] + "0", dedup_id="000" + dedup_max[3:]) == first
            assert sum(sh["compactions"] for sh in q.stats()["shards"]) >= 1
        restart_after_sigkill(svc)
        with svc.connect() as q:
            assert drain_all(q, "default", len(want["default"])) == want["default"]
            assert drain_all(q, "huge", len(want["huge"])) == want["huge"]


def test_a_batch_at_batch_jobs_max_and_one_at_the_request_size_limit():
    cfg = {"limits": {"compact_min_bytes": 4096}, "queues": {"default": {}, "huge": {"max_body_bytes": CEILING}}}
    with Service(shards=1, config=cfg) as svc:
        with svc.connect() as q:
            jobs = [{"body": body_of(i, 100), "key": f"k{i % 1000}"} for i in range(limits.BATCH_JOBS_MAX)]
            ids = q.enqueue_many(jobs)
            # 6 bodies at the ceiling: 96 MiB in one call. The router cuts it into requests
            # a shard accepts (each within REQUEST_BYTES_MAX); none is refused.
            big = [{"body": body_of(i, CEILING), "queue": "huge", "key": "big"} for i in range(6)]
            big_ids = q.enqueue_many(big)
            assert len(set(big_ids)) == 6 and q._shared().conns[0].connects == 1  # (a batch goes the shared way)
        restart_after_sigkill(svc)
        with svc.connect() as q:
            got = drain_all(q, "default", len(ids))
            assert got == {jid: (j["key"], digest(j["body"])) for jid, j in zip(ids, jobs)}
            bodies = []
            for _ in range(6):  # one key: FIFO order, one lease at a time
                leases = q.dequeue_many("huge", max_jobs=10, wait=5, visibility=600)
                assert len(leases) == 1
                bodies.append(digest(leases[0].body))
                q.ack(leases[0])
            assert bodies == [digest(j["body"]) for j in big]


def test_many_connections_each_sending_a_maximal_request_at_once():
    """Four clients, each on its own connection, send a request of three ceiling-sized
    bodies (48 MiB, near REQUEST_BYTES_MAX) at the same moment, so one loop iteration can
    hold several of them; its record is cut between requests. Then SIGKILL and restart:
    every job back, byte for byte."""
    import threading
    cfg = {"queues": {"huge": {"max_body_bytes": CEILING}}}
    clients = 4
    with Service(shards=1, config=cfg) as svc:
        start = threading.Barrier(clients)
        sent: dict[int, tuple] = {}
        errors = []

        def send(c: int) -> None:
            try:
                with svc.connect() as q:
                    jobs = [{"body": body_of(c * 3 + i, CEILING), "key": f"c{c}"} for i in range(3)]
                    start.wait()
                    for jid, job in zip(q.enqueue_many(jobs, queue="huge"), jobs):
                        sent[jid] = (job["key"], digest(job["body"]))
            except Exception as e:  # noqa: BLE001 - reported by the assert below
                errors.append(e)
        threads = [threading.Thread(target=send, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(sent) == 3 * clients
        restart_after_sigkill(svc)
        with svc.connect() as q:
            assert drain_all(q, "huge", len(sent)) == sent


def test_engine_refuses_a_batch_it_could_not_log_as_one_record(tmp_path):
    cfg = config_from(max_body_bytes=CEILING)
    e = Engine(str(tmp_path), cfg)
    n = limits.REQUEST_BYTES_MAX // CEILING + 1
    items = [(body_of(i, CEILING), "k", "default", 0, 0, None) for i in range(n)]
    with pytest.raises(shardq.InvalidJob, match="smaller batches"):
        e.enqueue_many(items)
    assert e.stats() == {} and e.state.jobs == {}
    with pytest.raises(shardq.InvalidJob, match="1 to 10000"):
        e.enqueue_many([(b"x", None, "default", 0, 0, None)] * (limits.BATCH_JOBS_MAX + 1))
    e.close()


def test_many_large_requests_in_one_iteration_are_cut_between_requests(tmp_path):
    """The operations of one loop iteration used to be one record, whatever their size."""
    cfg = config_from(max_body_bytes=CEILING)
    e = Engine(str(tmp_path), cfg)
    shard = e.shard
    want = {}
    for r in range(5):  # five requests of three ceiling-sized jobs, applied before one commit
        items = [(body_of(r * 3 + i, CEILING), f"key-{r}", "default", 0, 0, None) for i in range(3)]
        for jid, item in zip(shard.state.enqueue_many(items, e.clock.now(), (7, r + 1, r + 1)), items):
            want[jid] = (item[1], digest(item[0]))
    payloads = shard.take_payloads()
    assert len(payloads) >= 4 and all(len(p) <= RECORD_BYTES_MAX[SEGMENT] for p in payloads)
    for p in payloads:  # each request's jobs and session entry share a record
        ops = msgpack.unpackb(p)
        sessions = [op for op in ops if op[0] == 8]
        assert len([op for op in ops if op[0] == 1]) == 3 * len(sessions)
    e.shard.log.commit(payloads)
    e.close()
    e = Engine(str(tmp_path), cfg)
    got = {jid: (j.key, digest(j.body)) for jid, j in e.state.jobs.items()}
    assert got == want
    e.compact()  # checkpoint of ceiling-sized jobs: one job per record, each within the limit
    e.close()
    ckpt = [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")][0]
    data = open(os.path.join(tmp_path, ckpt), "rb").read()
    assert len(list(FileScan(ckpt, data, CHECKPOINT, tail_may_tear=False))) >= 15
    e = Engine(str(tmp_path), cfg)
    assert {jid: (j.key, digest(j.body)) for jid, j in e.state.jobs.items()} == want
    e.close()


def test_a_checkpoint_of_thousands_of_large_jobs():
    cfg = {"limits": {"compact_min_bytes": 4096}}
    with Service(shards=1, config=cfg) as svc:
        want = {}
        with svc.connect() as q:
            for start in range(0, 3000, 250):
                jobs = [{"body": body_of(i, limits.BODY_BYTES_MAX_DEFAULT // 4), "key": f"k{i % 300}"}
                        for i in range(start, start + 250)]
                for jid, job in zip(q.enqueue_many(jobs), jobs):
                    want[jid] = (job["key"], digest(job["body"]))
            leased = q.dequeue_many(max_jobs=50, visibility=600)  # leases are checkpointed too
            assert leased
        sh = os.path.join(svc.data_dir, "shard-0")
        ckpt = [n for n in os.listdir(sh) if n.endswith(".ckpt")]
        assert ckpt
        data = open(os.path.join(sh, ckpt[0]), "rb").read()
        sizes = []
        scan = FileScan(ckpt[0], data, CHECKPOINT, tail_may_tear=False)
        for p in scan:
            sizes.append(len(p))
        assert max(sizes) <= limits.CHECKPOINT_CHUNK_BYTES + limits.BODY_BYTES_MAX_DEFAULT
        restart_after_sigkill(svc)
        with svc.connect() as q:
            with pytest.raises(shardq.LeaseLost):
                q.ack(leased[0]._replace(token=leased[0].token + 10**9))
            assert q.ack_many(leased) == [None] * len(leased)  # leases survived with their tokens
            for lease in leased:
                del want[lease.job_id]
            assert drain_all(q, "default", len(want)) == want


def _write_v1_checkpoint(path: str, jobs: list[tuple[int, str, bytes]], chunk: int) -> None:
    """A checkpoint as shardq 0.1 wrote it: format 1 headers, chunks cut every ``chunk``
    jobs whatever their size."""
    header = struct.Struct("<II")
    import zlib
    ops = [[21, jid, "default", key, body, 0, 0, 0, 2, 0, 0.0, None] for jid, key, body in jobs]
    records = [[[20, len(jobs) + 1, 1]]] + [ops[i:i + chunk] for i in range(0, len(ops), chunk)]
    with open(path, "wb") as f:
        f.write(b"SHQCKP\x00\x01")
        for rec in records:
            p = msgpack.packb(rec)
            f.write(header.pack(len(p), zlib.crc32(p)) + p)
        p = msgpack.packb(["shardq-checkpoint-end", len(records)])
        f.write(header.pack(len(p), zlib.crc32(p)) + p)


def test_a_data_dir_broken_by_the_old_writer_is_repaired_without_loss():
    """What a user hit: an 82 MB checkpoint record. The shard refuses it with a message that
    names the repair; `shardq wal repair --force` rewrites it in bounded records; the
    service starts with every job."""
    import subprocess
    import sys
    from support.service import REPO
    data_dir = os.path.join(short_tmpdir(), "data")
    dd = DataDir(data_dir)
    dd.init(1)
    shard_dir = dd.shard_dir(0)
    os.makedirs(shard_dir, mode=0o700)
    jobs = [(((i + 1) << 10), f"user-{i % 97}", body_of(i, 40 * 1024)) for i in range(2600)]
    _write_v1_checkpoint(os.path.join(shard_dir, checkpoint_name(6)), jobs, chunk=2000)
    with open(os.path.join(shard_dir, segment_name(6)), "wb") as f:  # the checkpoint's segment, empty
        f.write(b"SHQWAL\x00\x01")
    svc = Service(data_dir=data_dir, shards=1)
    with pytest.raises(AssertionError, match="exited"):
        svc.start(timeout=60)
    svc.log.close()
    assert "its checksum is valid" in svc.tail(50) and "wal repair" in svc.tail(50)
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "shardq", "wal", "repair", shard_dir, "--force"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rewrote" in r.stdout and "nothing dropped" in r.stdout
    backups = [d for d in os.listdir(shard_dir) if d.startswith("repair-")]
    assert backups and os.stat(os.path.join(shard_dir, backups[0])).st_mode & 0o777 == 0o700
    for name in os.listdir(os.path.join(shard_dir, backups[0])):
        assert os.stat(os.path.join(shard_dir, backups[0], name)).st_mode & 0o777 == 0o600
    with Service(data_dir=data_dir, shards=1) as svc:
        with svc.connect() as q:
            got = drain_all(q, "default", len(jobs))
    assert got == {jid: (key, digest(body)) for jid, key, body in jobs}


def test_a_checkpoint_of_a_client_with_many_full_batches_unanswered():
    """A shard keeps, per client, the ids of every request at or above the client's lowest
    unanswered one, so a resend is answered without a second job. A bulk loader that sends
    a few hundred batches of BATCH_JOBS_MAX jobs before reading a reply leaves one session
    holding millions of ids; its checkpoint used to be one operation, past the checkpoint
    record limit, so compaction could not write it."""
    cfg = config_from()
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        e = Engine(d, cfg)
        ids = list(range(2**40, 2**40 + limits.BATCH_JOBS_MAX))  # 9 bytes each, as after 2^22 jobs
        seqs = limits.CHECKPOINT_RECORD_BYTES_MAX // (9 * limits.BATCH_JOBS_MAX) + 20
        now = e.clock.now()
        for cseq in range(1, seqs + 1):  # every request sent before any reply: low stays 1
            e.state.apply([8, 7, cseq, 1, ids, now])
        e.state.apply([8, 9, 1, 1, ids[:3], now])  # another client, seen later
        want = {cid: (entry[0], {s: list(v) for s, v in entry[1].items()}) for cid, entry in e.state.sessions.items()}
        sizes = [len(p) for p in e.state.snapshot()]
        assert max(sizes) <= RECORD_BYTES_MAX[CHECKPOINT], max(sizes)
        e.compact()
        e.close()
        e = Engine(d, cfg)
        got = {cid: (entry[0], {s: list(v) for s, v in entry[1].items()}) for cid, entry in e.state.sessions.items()}
        assert got == want and list(e.state.sessions) == [7, 9]  # least recently seen first
        # A resend of the first batch is still answered from the session, after the restart.
        assert e.enqueue_many([(b"x", None, "default", 0, 0, None)] * limits.BATCH_JOBS_MAX, session=(7, 1, 1)) == ids
        e.close()


def test_a_shard_at_queues_max_answers_stats_and_metrics_and_refuses_one_queue_more():
    """Any queue name works (unless the config declares its queues), so the count of queues
    needs a limit: every queue costs memory, and a stats or metrics reply lists them all,
    so past a few hundred thousand such a reply would pass the frame limit."""
    from shardq.protocol import wire
    from shardq.shard.state import ShardState
    state = ShardState(0, config_from())
    now = 1_000_000.0

    def name(i: int) -> str:  # as long as a queue name may be
        return f"{i:08d}".ljust(limits.QUEUE_NAME_BYTES_MAX, "q")

    for start in range(0, limits.QUEUES_MAX, limits.BATCH_JOBS_MAX):
        state.enqueue_many([(b"x", None, name(i), 0, 0, None) for i in range(start, start + limits.BATCH_JOBS_MAX)],
                           now)
    assert len(state.queues) == limits.QUEUES_MAX
    scrape = wire.pack({"queues": state.stats(), "queue_metrics": state.queue_metrics(now)})  # what metrics sends
    assert len(scrape) <= limits.REPLY_BYTES_MAX, len(scrape)
    state.take_batch()
    jobs = len(state.jobs)
    with pytest.raises(shardq.QueueFull, match=f"holds {limits.QUEUES_MAX} queues"):
        state.enqueue_many([(b"y", None, name(0), 0, 0, None), (b"z", None, name(limits.QUEUES_MAX), 0, 0, None)],
                           now)
    with pytest.raises(shardq.QueueFull):
        state.note_priorities(name(limits.QUEUES_MAX))
    with pytest.raises(shardq.QueueFull):  # a pause makes its queue too (it made 2,000 past the limit)
        state.pause(name(limits.QUEUES_MAX), now)
    assert state.pause(name(0), now)  # a queue it holds: as before
    state.take_batch()
    assert (len(state.jobs), len(state.queues), state.take_batch()[0]) == (jobs, limits.QUEUES_MAX, [])
    assert len(state.enqueue_many([(b"y", None, name(0), 0, 0, None)], now)) == 1  # a queue it holds: as before


def test_a_job_with_every_field_at_its_maximum_in_every_state_survives_compaction_and_restart(tmp_path):
    """Body at the ceiling, key, queue name and dedup id at their byte limits in 4-byte
    characters, priorities at both ends, the longest delay and lease, and error texts past
    their limit (kept cut to it): pending, delayed, leased, nacked with an error and dead.
    Every record the writer produced is within its limit, and the state comes back whole
    from the log and again from a checkpoint."""
    from shardq.clock import FakeClock
    from conftest import state_digest
    cfg = config_from(max_body_bytes=CEILING, max_deliveries=1000)
    clock = FakeClock()
    wide = "\U0001F600"                                    # 4 bytes of UTF-8
    queue = wide * (limits.QUEUE_NAME_BYTES_MAX // 4)
    key = lambda c: c * (limits.KEY_BYTES_MAX // 4)        # noqa: E731 - a one-line local helper
    dedup = lambda c: c * (limits.DEDUP_ID_BYTES_MAX // 4)  # noqa: E731 - a one-line local helper
    too_long_error = wide * (limits.ERROR_TEXT_BYTES_MAX // 4 + 100)
    e = Engine(str(tmp_path), cfg, clock=clock)
    ids = {}
    for n, (c, prio, delay) in enumerate([(wide, limits.PRIORITY_MAX, limits.DELAY_S_MAX),
                                          ("\U0001F601", limits.PRIORITY_MIN, 0.0),
                                          ("\U0001F602", limits.PRIORITY_MAX, 0.0),
                                          ("\U0001F603", limits.PRIORITY_MIN, 0.0)]):
        ids[n] = e.enqueue(body_of(n, CEILING), key(c), queue, delay=delay, priority=prio, dedup_id=dedup(c))
    held = {}
    for lease in [e.dequeue(queue, visibility=limits.VISIBILITY_TIMEOUT_S_MAX)[0] for _ in range(3)]:
        held[lease.job_id] = lease
    assert set(held) == {ids[1], ids[2], ids[3]}
    e.nack(ids[3], held[ids[3]].token, delay=limits.DELAY_S_MAX, error=too_long_error)
    e.bury(ids[1], held[ids[1]].token, error=too_long_error)
    [dead] = e.dead_letters(queue)
    assert dead.job_id == ids[1]
    assert len(dead.error.encode()) == limits.ERROR_TEXT_BYTES_MAX and too_long_error.startswith(dead.error)
    e.state.advance(clock.now())
    want = state_digest(e.state)
    assert want["jobs"][ids[2]][6] == "LEASED" and want["jobs"][ids[3]][9] == dead.error
    e.close()

    def reopened():
        e = Engine(str(tmp_path), cfg, clock=clock)
        e.state.advance(clock.now())
        return e
    e = reopened()  # from the log
    assert state_digest(e.state) == want
    e.compact()
    e.close()
    for name in os.listdir(tmp_path):  # the reader checks each record against its kind's limit
        kind = CHECKPOINT if name.endswith(".ckpt") else SEGMENT if name.endswith(".wal") else None
        if kind is not None:
            data = open(os.path.join(tmp_path, name), "rb").read()
            assert all(len(p) <= RECORD_BYTES_MAX[kind] for p in FileScan(name, data, kind, tail_may_tear=True))
    e = reopened()  # from the checkpoint
    assert state_digest(e.state) == want
    e.ack(ids[2], held[ids[2]].token)  # the lease held through both restarts
    e.close()
