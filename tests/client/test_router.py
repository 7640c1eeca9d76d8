"""The router against real shard processes: key placement, transparent reconnects, retries
that never duplicate a job when a shard is SIGKILLed under load, and what a shard does with
clients that hold the wrong key or send garbage.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from functools import partial
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import msgpack
import pytest

import shardq
from support.service import REPO, Service, parked_long_poll, restarted, short_tmpdir, wait_until
from shardq.datadir import DataDir
from shardq.errors import AuthError, InvalidJob, ShardUnavailable
from shardq.client.router import shard_for_key, shard_of_job
from shardq.protocol.sockio import connect_unix


A = "a"  # the key the garbage tests enqueue under; raw clients talk to its shard
SHARD_A = shard_for_key(A, 2)


@pytest.fixture
def svc():
    with Service(config={"queue_defaults": {"visibility_timeout": 30}}) as s:
        yield s


@pytest.fixture(scope="module")
def shared_svc():
    """One service for the table-driven garbage tests: each checks it changed nothing."""
    with Service() as s:
        with s.connect() as q:
            q.enqueue(b"keep", key=A)
        yield s


def drain_bodies(q) -> list[bytes]:
    out = []
    while True:
        leases = q.dequeue_many(max_jobs=1000)
        if not leases:
            return out
        out += [l.body for l in leases]
        assert q.ack_many(leases) == [None] * len(leases)



def log_count(svc, word: str) -> int:
    with open(svc.log_path, "rb") as f:
        return f.read().decode(errors="replace").count(word)


# ---------------------------------------------------------------------- placement
def test_key_placement_is_stable_across_processes_and_job_ids_name_their_shard(svc):
    keys = [f"user-{i}" for i in range(40)] + ["ключ", "🔑", "a" * 300]
    code = ("import sys, json; from shardq.client.router import shard_for_key; "
            "print(json.dumps([shard_for_key(k, 2) for k in json.loads(sys.argv[1])]))")
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert json.loads(out) == [shard_for_key(k, 2) for k in keys]
    with svc.connect() as q:
        ids = q.enqueue_many([{"body": k.encode(), "key": k} for k in keys])
        assert [shard_of_job(j) for j in ids] == [shard_for_key(k, 2) for k in keys]
        keyless = [q.enqueue(b"x") for _ in range(6)]
        assert Counter(shard_of_job(j) for j in keyless) == {0: 3, 1: 3}  # round-robin
        st = q.stats()["shards"]
        assert [sh["jobs"] for sh in st] == [
            sum(shard_for_key(k, 2) == s for k in keys) + 3 for s in (0, 1)]


# ---------------------------------------------------------------------- reconnects
def test_sigkill_of_a_shard_under_load_loses_and_duplicates_nothing(svc):
    ok: dict[bytes, int] = {}          # body -> id, for every enqueue that returned
    unknown: list[bytes] = []          # enqueues that raised ShardUnavailable
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    keys = ["k-a", "k-b", "k-c", "k-d", None]

    def produce(t: int, q):
        i = 0
        try:
            while not stop.is_set():
                body = f"t{t}-{i}".encode()
                key = keys[i % len(keys)]
                i += 1
                try:
                    jid = q.enqueue(body, key=key)
                except ShardUnavailable:
                    with lock:
                        unknown.append(body)
                    continue
                with lock:
                    ok[body] = jid
        except BaseException as e:  # noqa: BLE001 - reported by the test's main thread
            errors.append(e)

    shared = svc.connect(retry_s=10)  # six threads: combined rounds (shardq/client/combine.py) meet the kills too
    routers = [*[shared] * 6, svc.connect(retry_s=10), svc.connect(retry_s=10)]
    threads = [threading.Thread(target=produce, args=(t, r)) for t, r in enumerate(routers)]
    try:
        for t in threads:
            t.start()
        for shard in (0, 1, 0, 1, 0):
            wait_until(lambda: len(ok) >= 100 or None, 30, what="enqueues to flow")
            pid = svc.shard_pids()[shard]
            os.kill(pid, signal.SIGKILL)
            restarted(svc, shard, pid)
            with lock:
                mark = len(ok)
            wait_until(lambda: len(ok) >= mark + 100 or None, 30, what="enqueues after the restart")
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors
    finally:
        stop.set()
        for r in set(routers):
            r.close()
    assert log_count(svc, "event=shard-restart") == 5
    assert sum(c.rounds for pair in shared._combiners for c in pair) > 0
    with svc.connect() as q:
        delivered = drain_bodies(q)
    dups = [b for b, n in Counter(delivered).items() if n > 1]
    assert dups == [], f"duplicated by retries: {dups[:10]}"
    lost = set(ok) - set(delivered)
    assert not lost, f"{len(lost)} acknowledged enqueues lost, e.g. {sorted(lost)[:5]}"
    assert set(delivered) <= set(ok) | set(unknown)
    print(f"enqueued {len(ok)}, ShardUnavailable {len(unknown)}, "
          f"of which delivered {len(set(unknown) & set(delivered))}")


# ---------------------------------------------------------------------- authentication
def observable(q) -> list[dict]:
    """Per shard: what a rejected request must not change."""
    return [{k: v for k, v in sh.items() if k not in ("clients", "iterations")} for sh in q.stats()["shards"]]


def test_wrong_key_is_rejected_while_other_clients_keep_working(svc):
    dd = DataDir(svc.data_dir)
    fake_root = short_tmpdir()
    try:
        with svc.connect() as good:
            good.enqueue(b"x", key="a")
            seen = observable(good)
            pids = good.ping()
            # 1. A raw client with a wrong key, on each shard socket.
            for i in range(2):
                with pytest.raises(AuthenticationError):
                    Client(dd.socket_path(i), family="AF_UNIX", authkey=b"not-the-key-" * 4)
            # 2. A router on a copy of the data dir whose key file differs (same sockets).
            fake = os.path.join(fake_root, "data")
            os.makedirs(fake, mode=0o700)
            shutil.copy(os.path.join(svc.data_dir, "shardq.json"), fake)
            os.symlink(dd.run_dir, os.path.join(fake, "run"))
            fd = os.open(os.path.join(fake, "authkey"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"0" * 64)
            os.close(fd)
            with pytest.raises(AuthError, match="authentication failed"):
                with shardq.connect(fake, retry_s=2) as bad:
                    bad.ping()
            # The good client never noticed.
            assert good.ping() == pids
            assert observable(good) == seen
            lease = good.dequeue()
            assert lease.body == b"x"
            good.ack(lease)
    finally:
        shutil.rmtree(fake_root, ignore_errors=True)
    assert "client rejected during authentication" in svc.tail(100)


# ---------------------------------------------------------------------- garbage
def raw(svc, shard: int = SHARD_A) -> Client:
    dd = DataDir(svc.data_dir)
    return connect_unix(dd.socket_path(shard), dd.authkey())


def reply(conn: Client, timeout: float = 5.0):
    assert conn.poll(timeout), "no reply"
    return msgpack.unpackb(conn.recv_bytes(), raw=False)


def disconnected(conn: Client, timeout: float = 5.0) -> bool:
    """True if the shard closes the connection (after maybe an error reply)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(max(deadline - time.monotonic(), 0)):
            try:
                conn.recv_bytes()
            except (EOFError, OSError):
                return True
    return False


NAN = float("nan")
BIG = 2**64 - 1

#: Frames that cannot be answered: the shard must drop the connection.
DROP = {
    "random bytes": random.Random(7).randbytes(200),
    "truncated msgpack": msgpack.packb([[1, "ping", []]])[:-2],
    "map, not array": msgpack.packb({"op": "ping"}),
    "int, not array": msgpack.packb(12345),
    "request not a triple": msgpack.packb([[1, "ping"]]),
    "request id not int": msgpack.packb([["1", "ping", []]]),
    "op not a string": msgpack.packb([[1, 7, []]]),
    "deep nesting": b"\x91" * 100_000 + b"\xc0",
    "invalid utf-8 str": b"\x91\x93\x01\xa4pi\xffg\x90",
}

#: Well-formed frames with invalid requests: the shard must answer each with an error.
ERRORS = {
    "unknown op": [[1, "frobnicate", []]],
    "args not an array": [[1, "ping", 5]],
    "wrong arity": [[1, "dequeue", ["default"]]],
    "enqueue items not array": [[1, "enqueue", ["nope", None]]],
    "enqueue empty batch": [[1, "enqueue", [[], None]]],
    "enqueue bad item": [[1, "enqueue", [[[b"b", None, "default", 0, 0]], None]]],
    "enqueue str body": [[1, "enqueue", [[["text", None, "default", 0, 0, None]], None]]],
    "enqueue empty body": [[1, "enqueue", [[[b"", None, "default", 0, 0, None]], None]]],
    "enqueue int key": [[1, "enqueue", [[[b"b", 5, "default", 0, 0, None]], None]]],
    "enqueue bad queue": [[1, "enqueue", [[[b"b", None, ["q"], 0, 0, None]], None]]],
    "enqueue nan delay": [[1, "enqueue", [[[b"b", None, "default", NAN, 0, None]], None]]],
    "enqueue negative delay": [[1, "enqueue", [[[b"b", None, "default", -1, 0, None]], None]]],
    "enqueue huge delay": [[1, "enqueue", [[[b"b", None, "default", BIG, 0, None]], None]]],
    "enqueue huge priority": [[1, "enqueue", [[[b"b", None, "default", 0, BIG, None]], None]]],
    "enqueue float priority": [[1, "enqueue", [[[b"b", None, "default", 0, 1.5, None]], None]]],
    "enqueue bad dedup": [[1, "enqueue", [[[b"b", None, "default", 0, 0, [1]]], None]]],
    "enqueue huge session": [[1, "enqueue", [[[b"b", None, "default", 0, 0, None]], [BIG, 1, 1]]]],
    "enqueue short session": [[1, "enqueue", [[[b"b", None, "default", 0, 0, None]], [1, 2]]]],
    "enqueue session of str": [[1, "enqueue", [[[b"b", None, "default", 0, 0, None]], ["a", "b", "c"]]]],
    "dequeue queue not str": [[1, "dequeue", [123, None, 1]]],
    "dequeue queue unhashable": [[1, "dequeue", [[1], None, 1]]],
    "dequeue huge max": [[1, "dequeue", ["default", None, BIG]]],
    "dequeue zero max": [[1, "dequeue", ["default", None, 0]]],
    "dequeue nan visibility": [[1, "dequeue", ["default", NAN, 1]]],
    "dequeue zero visibility": [[1, "dequeue", ["default", 0, 1]]],
    "ack not pairs": [[1, "ack", ["x"]]],
    "nack huge ids": [[1, "nack", [BIG, BIG, 0, None, True]]],
    "nack float id": [[1, "nack", [1.5, 1, 0, None, True]]],
    "extend strings": [[1, "extend", ["a", "b", "c"]]],
    "extend nan": [[1, "extend", [1024, 1, NAN]]],
    "watch queue not str": [[1, "watch", [5, 1]]],
    "watch timeout str": [[1, "watch", ["idle", "soon"]]],
    "watch nan timeout": [[1, "watch", ["idle", NAN]]],
    "dead_letters bad limit": [[1, "dead_letters", ["default", -1]]],
    "dead_letters unhashable queue": [[1, "dead_letters", [{"a": 1}, 10]]],
    "redrive bad ids": [[1, "redrive", ["default", "all"]]],
    "redrive huge id": [[1, "redrive", ["default", [BIG]]]],
    "purge unhashable": [[1, "purge_dead", [[1]]]],
    "queue_config none": [[1, "queue_config", [None]]],
    "stats with args": [[1, "stats", [1]]],
}

#: Per-item errors: the reply is OK, each item carries its error.
ITEM_ERRORS = {
    "ack huge ids": [[1, "ack", [[[BIG, BIG], [-2**63, 1], [1024, -1]]]]],
    "ack bad pair": [[1, "ack", [[["a", "b"], [1]]]]],
    "ack unknown job": [[1, "ack", [[[1 << 40, 1]]]]],
}


def test_garbage_frames_drop_only_the_sender(shared_svc):
    svc = shared_svc
    with svc.connect() as good:
        pids = good.ping()
        seen = observable(good)
        for name, frame in DROP.items():
            conn = raw(svc)
            try:
                conn.send_bytes(frame)
                assert disconnected(conn), f"{name}: connection kept"
            finally:
                conn.close()
            assert good.ping() == pids, f"{name}: shard died"
        # A frame announcing more than the limit is refused before it is read.
        for header in (struct.pack("!i", 2**31 - 1), struct.pack("!i", -1) + struct.pack("!Q", 2**63)):
            conn = raw(svc)
            try:
                conn._send(header)
                assert disconnected(conn), "oversized frame: connection kept"
            finally:
                conn.close()
        assert good.ping() == pids
        assert observable(good) == seen


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_invalid_request_gets_an_error_reply_and_changes_nothing(shared_svc, name):
    svc = shared_svc
    with svc.connect() as good:
        pids = good.ping()
        seen = observable(good)
        conn = raw(svc)
        try:
            conn.send_bytes(msgpack.packb(ERRORS[name]))
            (rid, status, payload), = reply(conn)
            assert (rid, status) == (1, 1), payload
            assert payload[0] in ("InvalidJob", "ProtocolError", "UnknownQueue"), payload
            # The same connection still works.
            conn.send_bytes(msgpack.packb([[2, "ping", []]]))
            assert reply(conn) == [[2, 0, pids[SHARD_A]]]
        finally:
            conn.close()
        assert good.ping() == pids
        assert observable(good) == seen


def test_invalid_items_get_per_item_errors(shared_svc):
    svc = shared_svc
    with svc.connect() as good:
        pids = good.ping()
        seen = observable(good)
        conn = raw(svc)
        try:
            for name, frame in ITEM_ERRORS.items():
                conn.send_bytes(msgpack.packb(frame))
                (rid, status, errs), = reply(conn)
                assert status == 0 and errs and all(e and e[0] in ("InvalidJob", "NotFound", "JobGone")
                                                    for e in errs), (name, errs)
        finally:
            conn.close()
        assert good.ping() == pids
        assert observable(good) == seen


def test_huge_request_id_and_stalled_partial_frame(shared_svc):
    svc = shared_svc
    with svc.connect() as good:
        pids = good.ping()
        conn = raw(svc)
        stalled = raw(svc)
        try:
            conn.send_bytes(msgpack.packb([[BIG, "ping", []]]))
            assert reply(conn) == [[BIG, 0, pids[SHARD_A]]]
            # Half a frame, then silence: the shard must keep serving everyone else.
            stalled._send(struct.pack("!i", 1000) + b"\x91" * 10)
            t0 = time.monotonic()
            for _ in range(5):
                assert good.ping() == pids
            assert time.monotonic() - t0 < 1.0
            stalled._send(b"\x00" * 990)  # the rest of the frame: garbage, so dropped
            assert disconnected(stalled)
        finally:
            conn.close()
            stalled.close()
        assert good.ping() == pids


def test_many_connections_and_abrupt_disconnects_do_not_hurt_the_shard(svc):
    with svc.connect() as good:
        pids = good.ping()
        conns = [raw(svc, i % 2) for i in range(40)]
        for c in conns[:20]:
            c.send_bytes(msgpack.packb([[1, "watch", ["default", 30]]]))  # then vanish mid-watch
        for c in conns:
            c.close()
        assert good.ping() == pids
        good.enqueue(b"wake the watchers", key="a")  # replies to closed sockets are dropped
        lease = good.dequeue(wait=2)
        assert lease is not None and lease.body == b"wake the watchers"
        good.ack(lease)
        assert good.ping() == pids


def test_closing_a_router_releases_its_shard_connections_and_threads(svc):
    def clients(q) -> list[int]:
        return [sh["clients"] for sh in q.stats()["shards"]]

    def io_threads() -> int:
        return sum(t.name == "shardq-io" for t in threading.enumerate())

    with svc.connect() as q:
        base_clients, base_io = clients(q), io_threads()
        for _ in range(10):
            r = svc.connect()
            r.ping()  # every shard at once: the shared way, on the router's I/O thread
            r.enqueue(b"x", key=A)  # alone: on a lane
            assert io_threads() == base_io + 1 and sum(lanes.connects for lanes in r.lanes) == 1
            r.close()
            assert io_threads() == base_io  # joined by close()
            with pytest.raises(shardq.Closed):
                r.enqueue(b"y", key=A)
        wait_until(lambda: clients(q) == base_clients, 3, 0.05, "shards to see the closed connections")


def test_closing_a_router_ends_a_wait_another_thread_has_on_its_io_thread(svc):
    """A thread waits the shared way (a dequeue over both shards, parked on the I/O thread's
    connections) when another thread closes the router: its call ends at once (Closed, or
    nothing leased), not when its 20 s wait would, and close() returns."""
    q = svc.connect()
    t, out = parked_long_poll(q, "idle", 20)
    started = time.monotonic()
    q.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 5
    assert len(out) == 1 and (isinstance(out[0], shardq.Closed) or out[0] == []), out


def test_closing_a_router_while_threads_enqueue_in_combined_rounds_ends_every_call(svc):
    """Sixteen threads enqueue on one shard (combined rounds, shardq/client/combine.py) when
    another thread closes the router: every call ends, with its id, Closed (never sent) or
    OutcomeUnknown (sent, its reply not read), and close() returns; every id returned is a
    job the shard holds."""
    q = svc.connect()
    got: list = []
    guard = threading.Lock()

    def produce(t: int) -> None:
        for i in range(10_000):
            try:
                out = (b"%d-%d" % (t, i), q.enqueue(b"%d-%d" % (t, i), key=A))
            except shardq.ShardqError as e:
                out = (None, e)
            with guard:
                got.append(out)
            if out[0] is None:
                return

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(c.rounds for c in q._combiners[SHARD_A]) >= 20, 20, what="combined rounds")
    started = time.monotonic()
    q.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - started < 10
    ends = [e for body, e in got if body is None]
    assert len(ends) == 16 and all(isinstance(e, (shardq.Closed, shardq.OutcomeUnknown)) for e in ends), ends[:3]
    with svc.connect() as r:
        for body, job_id in got:
            if body is not None:
                assert r.job(job_id)["body"] == body


def test_a_closed_router_never_reads_from_a_reused_descriptor(svc):
    """Closing a router must not leave a reader thread that reads whatever file later gets
    the same descriptor number (here: a child's stdout pipe, created right after)."""
    echo = shutil.which("echo")
    if echo is None:
        pytest.skip("no echo binary")
    damaged = []
    for _i in range(40):
        q = svc.connect()
        q.enqueue(b"x", key="k")
        q.close()
        out = subprocess.run([echo, "0123456789"], capture_output=True, timeout=10).stdout
        if out != b"0123456789\n":
            damaged.append(out)
    assert damaged == [], f"{len(damaged)} of 40 child outputs lost bytes to a stale reader: {damaged[:3]}"


def count_lanes(monkeypatch) -> Counter:
    """Counts each call a lane was offered, by op and by way: ``lane`` (it made it) or
    ``shared`` (it declined: taken, or not connected)."""
    from shardq.client import connection

    paths: Counter = Counter()
    real = connection.Lanes.call

    def call(self, op, args, timeout, *wait):
        out = real(self, op, args, timeout, *wait)
        paths[op, "shared" if out is connection.SHARED else "lane"] += 1
        return out

    monkeypatch.setattr(connection.Lanes, "call", call)
    return paths


def test_a_lone_caller_takes_its_lane_and_threads_meeting_it_taken_are_combined_losing_nothing(svc, monkeypatch):
    """A caller on a free lane of its shard sends and reads its own reply there; threads
    whose single enqueue meets that lane taken are combined (shardq/client/combine.py): one
    request a round for them all. Every enqueue must come back with its own job's id."""
    from shardq.client.connection import LANES_MAX

    paths = count_lanes(monkeypatch)
    with svc.connect() as q:
        q.ping()
        q.queue_config("default")  # the queue's placement, asked once before its first enqueue
        paths.clear()
        q.enqueue(b"alone", key=A)
        assert paths == {("enqueue", "lane"): 1}, paths

        ids: dict[bytes, int] = {}
        def produce(t: int) -> None:
            for i in range(150):
                body = f"{t}-{i}".encode()
                ids[body] = q.enqueue(body, key=A)  # one key: one shard
        threads = [threading.Thread(target=produce, args=(t,)) for t in range(2 * LANES_MAX)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(set(ids.values())) == len(ids) == 2 * LANES_MAX * 150
        assert q._combiners[SHARD_A][0].rounds > 0
        assert paths["enqueue", "lane"] < 1 + len(ids), paths  # rounds carried several
        for body, job_id in ids.items():
            assert q.job(job_id)["body"] == body
        assert sorted(drain_bodies(q)) == sorted([b"alone", *ids])


def test_a_single_enqueue_whose_lanes_cannot_connect_goes_the_shared_way(svc, monkeypatch):
    """After a failed connect a shard's lanes are not tried for DOWN_S: a single enqueue
    and ack go the shared way (the I/O thread's connection, which retries), and arrive."""
    paths = count_lanes(monkeypatch)
    with svc.connect() as q:
        q.ping()
        for lanes in q.lanes:
            lanes.all[0].broken()
            lanes.down_until = time.monotonic() + 3600
        paths.clear()
        job_id = q.enqueue(b"shared", key=A)
        lease = q.dequeue("default")
        assert lease is not None and lease.job_id == job_id and lease.body == b"shared"
        q.ack(lease)
        assert paths["enqueue", "shared"] == paths["ack", "shared"] == 1, paths
        assert q.stats()["queues"]["default"]["ready"] == 0


def test_a_shard_opens_lanes_max_lanes_and_the_caller_beyond_goes_the_shared_way():
    """At the limit: LANES_MAX threads each wait alone on a one-shard router, each on a lane
    of its own (all of them open); the next one finds every lane taken and waits the shared
    way, on the I/O thread. One job each wakes them all, every job leased once."""
    from shardq.client.connection import LANES_MAX

    with Service(shards=1) as one:
        q = one.connect()
        try:
            got: list = []
            threads = [threading.Thread(target=lambda: got.append(q.dequeue("idle", wait=20)))
                       for _ in range(LANES_MAX)]
            for t in threads:
                t.start()
            wait_until(lambda: sum(lane.lock.locked() for lane in q.lanes[0].all) == LANES_MAX, 10,
                       what="every lane taken by a wait")
            assert len(q.lanes[0].all) == LANES_MAX and q.lanes[0].busy()
            # The next waits the shared way, for one job: the shard may park it before a lane's
            # wait it has not yet read, so a larger batch could take a lane waiter's job.
            t, out = parked_long_poll(q, "idle", 20, max_jobs=1)
            threads.append(t)
            ids = q.enqueue_many([{"body": b"%d" % i} for i in range(LANES_MAX + 1)], queue="idle")
            for t in threads:
                t.join(20)
            assert sorted(lease.job_id for lease in [*got, *out[0]]) == sorted(ids)
        finally:
            q.close()


def test_a_solo_call_that_times_out_drops_its_late_reply(svc):
    """The shard stops (SIGSTOP) during a lone call: the call fails with ShardUnavailable
    after ``request_timeout_s``; once the shard runs again, the late reply of that call is
    dropped, and the next call gets its own reply, not the stale one."""
    with svc.connect(request_timeout_s=0.5, retry_s=0.5) as q:
        pid = q.ping()[SHARD_A]
        q.queue_config("default")  # its placement known: the lone call is the enqueue itself
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ShardUnavailable, match="did not answer enqueue"):
                q.enqueue(b"late", key=A)
        finally:
            os.kill(pid, signal.SIGCONT)
        second = q.enqueue(b"next", key=A)
        assert q.job(second)["body"] == b"next"
        assert sorted(drain_bodies(q)) == [b"late", b"next"]  # the timed-out call was applied


def test_a_call_to_a_paused_shard_with_no_lane_yet_gives_up_within_its_retry_s(svc):
    """Found by a walkthrough: a router's first call to a shard that is paused (SIGSTOP: its
    acceptor takes no handshake) waited the lane's whole handshake timeout (2 s), then the
    shared way's full retry_s on top: ShardUnavailable 3.3 s into a call with retry_s = 1.
    The lane's handshake now gives up after 0.25 s and the shared way retries for what is
    left of the call's retry_s."""
    with svc.connect() as first:
        pid = first.ping()[SHARD_A]
    os.kill(pid, signal.SIGSTOP)
    try:
        with svc.connect(request_timeout_s=1, retry_s=1) as q:
            started = time.monotonic()
            with pytest.raises(ShardUnavailable):
                q.enqueue(b"x", key=A)
            took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 2.0, f"ShardUnavailable after {took:.2f} s, retry_s = 1"


def test_a_lone_waiting_dequeue_takes_its_lane_and_is_withdrawn_when_it_passes(monkeypatch):
    """Issue 47: a waiting dequeue alone is sent and read by its caller on the shard's lane
    (no future, no hand-off), as a lone dequeue is. One whose reply does not come within
    its wait is withdrawn (``cancel_wait``), and the lease the shard answers late is released
    unstarted, not left to expire with its delivery counted."""
    from shardq import limits
    from support.fake_shard import FakeShards

    paths = count_lanes(monkeypatch)
    late = threading.Event()  # the shard answers the second wait only once it is set
    rows = [[(n << limits.JOB_ID_SHARD_BITS), None, b"job", 1, 100 + n, 9e9, 0, False] for n in (1, 2)]

    def answer(shard, op, args):
        if op == "dequeue_wait":
            if len(f.sent("dequeue_wait")) == 2:
                late.wait(10)
                return [rows[1]]
            return [rows[0]]
        return [] if op == "dequeue" else None

    f = FakeShards(1, answer)
    try:
        with shardq.connect(f.dd.path, retry_s=2, request_timeout_s=10) as q:
            lease = q.dequeue("default", wait=5)  # the plain dequeue finds nothing: it waits
            assert lease is not None and lease.job_id == rows[0][0]
            assert paths == {("dequeue", "lane"): 1, ("dequeue_wait", "lane"): 1}, paths
            assert q.dequeue("default", wait=0.2) is None  # its reply does not come within 0.2 + 0.5 s
            late.set()  # (the fake reads the withdrawal, written before, once it has answered)
            wait_until(lambda: f.sent("cancel_wait"), 5, what="the withdrawal")
            # The shard stalled past the withdrawal's settling time: the late reply waits on
            # the lane for its next caller, which reads it and releases its lease.
            assert q.ping() == [None]
            wait_until(lambda: [a[:3] + a[4:] for _, _, a in f.sent("nack")] == [[rows[1][0], rows[1][4], 0, False]],
                       5, what="the late lease released unstarted")
    finally:
        late.set()
        f.close()


def test_a_lone_waiting_dequeue_that_finds_its_lane_taken_goes_the_shared_way(monkeypatch):
    """The lane declines (another thread took it between the wait's start and its send):
    the wait goes the shared way in the lone one's place, and its lease comes back."""
    from shardq import limits
    from shardq.client import connection
    from support.fake_shard import FakeShards

    real = connection.Lanes.call
    declined = []

    def call(self, op, args, timeout, *wait):
        if op == "dequeue_wait":
            declined.append(op)
            return connection.SHARED
        return real(self, op, args, timeout, *wait)

    monkeypatch.setattr(connection.Lanes, "call", call)
    row = [1 << limits.JOB_ID_SHARD_BITS, None, b"job", 1, 101, 9e9, 0, False]
    f = FakeShards(1, lambda shard, op, args: [row] if op == "dequeue_wait" else [] if op == "dequeue" else None)
    try:
        with shardq.connect(f.dd.path, retry_s=2, request_timeout_s=10) as q:
            started = time.monotonic()
            lease = q.dequeue("default", wait=5)
            assert lease is not None and lease.job_id == row[0] and declined == ["dequeue_wait"]
            assert time.monotonic() - started < 4  # woken by its reply, not by the end of the wait
    finally:
        f.close()


def test_a_settled_request_leaves_no_garbage_cycle():
    """Calls the shared way (two shards at once: settled by the I/O thread) leave nothing
    for the cyclic collector (the SQS listener once counted ~26 objects a batch send in
    ``Future.req`` <-> ``Request.waiters`` cycles)."""
    import asyncio
    import gc

    from shardq.client.channel import Request
    from shardq.loop_thread import _Reply
    from support.fake_shard import FakeShards

    f = FakeShards(2, lambda shard, op, args: 7)
    try:
        with shardq.connect(f.dd.path, retry_s=2, request_timeout_s=10) as q:
            assert q.ping() == [7, 7]  # connected
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(20):
                    assert q.ping() == [7, 7]
                gc.collect()
                cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, (asyncio.Future, _Reply, Request))]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert cyclic == []
    finally:
        f.close()


def test_a_combined_enqueue_refused_as_a_whole_is_made_again_item_by_item(svc):
    """The router's round: one request for every item; one the shard refuses whole (a
    malformed item) is made again item by item, so only its caller fails."""
    with svc.connect() as q:
        q.ping()
        shard = q._placed("default", "k", 0)
        shard = 0 if shard is None else shard
        good = shardq.client.routing.job_item(b"good", None, "default", 0, 0, None)
        out = q._round(shard, "enqueue", [good, [b"bad", None, "default", 0, 0]])  # five fields
        assert isinstance(out[1], InvalidJob) and isinstance(out[0], int)
        assert q.job(out[0])["body"] == b"good" and q.stats()["queues"]["default"]["ready"] == 1


def test_a_combined_ack_refused_as_a_whole_is_made_again_item_by_item(svc):
    """An ack round whose request the shard (or the encoder) refuses whole (a lease id out
    of range): made again lease by lease, so the good lease is acked and only the bad one's
    caller fails."""
    with svc.connect() as q:
        job_id = q.enqueue(b"a", key=A)
        lease = q.dequeue("default")
        assert lease is not None and lease.job_id == job_id
        good, bad = [lease.job_id, lease.token], [1 << 70, lease.token]
        out = q._round(SHARD_A, "ack", [good, bad])
        assert out[0] == (None, False) and isinstance(out[1], InvalidJob), out
        with pytest.raises(shardq.errors.NotFound):  # acked: gone
            q.job(job_id)


def test_a_combined_round_at_its_limits_is_one_request_the_shard_takes(svc):
    """The largest round the combiner makes (shardq/client/combine.py): BATCH_JOBS_MAX
    enqueues, keys and dedup ids at their longest, MERGE_BYTES_MAX bytes of bodies, goes as
    one request (far below the frame limit) and every job is added once."""
    from shardq import limits
    from shardq.client.channel import MERGE_BYTES_MAX

    n = limits.BATCH_JOBS_MAX
    body = MERGE_BYTES_MAX // n
    with svc.connect() as q:
        q.ping()
        key = "k" * limits.KEY_BYTES_MAX
        shard = shard_for_key(key, 2)
        items = [shardq.client.routing.job_item(b"%0*d" % (body, i), key, "default", 0, 0,
                                                str(i).zfill(limits.DEDUP_ID_BYTES_MAX)) for i in range(n)]
        ids = q._round(shard, "enqueue", items)
        assert len(set(ids)) == n and all(isinstance(i, int) for i in ids)
        assert q.stats()["queues"]["default"]["ready"] + q.stats()["queues"]["default"].get("waiting", 0) == n


def test_a_combined_round_with_one_dedup_id_twice_adds_one_job_as_two_calls_would(svc):
    """Two callers' enqueues with the same dedup id, queue and key in one round: the shard
    answers both with the first job's id and adds one job, as it does for two calls."""
    with svc.connect() as q:
        q.ping()
        item = partial(shardq.client.routing.job_item, key=A, queue="default", delay=0, priority=0, dedup_id="once")
        ids = q._round(SHARD_A, "enqueue", [item(b"first"), item(b"second")])
        assert ids[0] == ids[1] and q.job(ids[0])["body"] == b"first"
        assert q.enqueue(b"third", key=A, dedup_id="once") == ids[0]
        assert drain_bodies(q) == [b"first"]


def test_the_io_thread_starting_with_the_service_gone_does_not_add_its_connects_to_the_call():
    """The first call after the service went away that needed the router's I/O thread
    (a keyless enqueue's re-send, a wait) waited up to 2 s for the thread's connects to every
    shard and then its own retry_s: retry_s + 1.9 s (found: 6.9 s with retry_s 5). The
    thread now tries its first connects for IO_CONNECT_S (0.25 s) only: a shard it did not
    reach is connected to when a request needs it."""
    with Service(shards=2) as svc:
        q = shardq.connect(svc.data_dir, retry_s=5)
        try:
            q.enqueue(b"warm", key="a")
            svc.stop()
            started = time.monotonic()
            q._shared()  # what the first such call starts
            assert time.monotonic() - started < 1.5  # (was 2 s: min(retry_s, 2))
        finally:
            q.close()


def test_a_lone_wait_whose_lane_is_taken_and_whose_shard_is_not_connected_ends_the_wait(fake):
    """A lone waiting dequeue whose lane another caller took goes the shared way; when that
    shard is not connected there either, the wait is over (ShardUnavailable, the caller's
    next round reaches it again). Its handle was left None, so the wait went on asking the
    I/O thread to wait for nothing: ``asyncio.wait`` of no future, a ValueError that ended
    `shardq worker` (a walkthrough, 3 of 6 runs, a queue placed on a shard SIGKILLed)."""
    from shardq.client.connection import SHARED
    from shardq.client.core import Call
    from shardq.client.effects import OPEN, wait_any

    f = fake(1, lambda shard, op, args: [])

    class NotConnected:  # the I/O thread's client, with its connection to the shard down
        loop = asyncio.new_event_loop()  # (its clock only)

        def _park(self, effect):
            return None, [None]

        def _wake(self, effect):
            raise AssertionError("asked to wait for nothing")

        def _abandon(self, effect):
            return [OPEN for _ in effect.handles]

    with shardq.connect(f.dd.path) as q:
        q.lanes[0].call = lambda *args, **kw: SHARED  # the lane taken between Park and Wake
        q._on_io = lambda start: start(NotConnected())
        got = q._drive(wait_any(q, [Call(0, "dequeue_wait", ["jobs", None, 1, 0.2])], 0.5, 0.5))
    NotConnected.loop.close()
    assert got == [None]
