"""Hostile clients against a real shard service.

Every bad client must get an error reply or a disconnect; the shard must keep serving a good
client throughout (same pid), and a rejected request must change neither the state nor the
log. Frames come from a seeded generator (the seed is in the failure message), so any failure
replays.
"""
from __future__ import annotations

import copy
import math
import os
import random
import select
import socket
import struct
from multiprocessing.connection import AuthenticationError, Client

import msgpack
import pytest
from support.service import Service, wait_until

from shardq import limits
from shardq.protocol import wire as protocol
from shardq.datadir import DataDir
from shardq.errors import ProtocolError, ShardqError
from shardq.client.router import shard_for_key
from shardq.protocol.sockio import connect_unix

SEED = int(os.environ.get("SHARDQ_FUZZ_SEED", "20261130"))
FRAMES = int(os.environ.get("SHARDQ_FUZZ_FRAMES", "600"))
REPLY_S = 5.0


@pytest.fixture(scope="module")
def svc():
    cfg = {"queue_defaults": {"max_deliveries": 1_000_000}, "service": {"restart_backoff_max": 0.5}}
    with Service(shards=2, config=cfg) as s:
        s.dd = DataDir(s.data_dir)
        s.good = s.connect(retry_s=5, request_timeout_s=5)
        s.pids = s.good.ping()
        yield s
        s.good.close()


def raw(svc, shard=0):
    return connect_unix(svc.dd.socket_path(shard), svc.dd.authkey())


def exchange(conn, frame: bytes, wait: float = REPLY_S):
    """Send one raw frame; every reply to it (the replies of one frame may come in several
    frames: those that changed nothing leave before the fsync, the others after), "closed",
    or None (no reply within ``wait``)."""
    try:
        conn.send_bytes(frame)
        if not conn.poll(wait):
            return None
        replies = msgpack.unpackb(conn.recv_bytes(), raw=False, strict_map_key=False)
        expected = _answerable(frame)
        while isinstance(replies, list) and len(replies) < expected and conn.poll(0.5):
            replies += msgpack.unpackb(conn.recv_bytes(), raw=False, strict_map_key=False)
        return replies
    except (EOFError, OSError):
        return "closed"


#: ops whose reply may come later (a watch, a waiting dequeue)
DEFERRED_OPS = ("watch", "dequeue_wait")


def _answerable(frame: bytes) -> int:
    """How many replies a frame's requests get at once (watches may answer later)."""
    reqs = requests_in(frame)
    return sum(1 for r in reqs or () if isinstance(r, list) and len(r) == 3 and r[1] not in DEFERRED_OPS)


def fingerprint(svc, shard=0) -> dict:
    """What a rejected request must not change: jobs, per-queue totals, log bytes, files."""
    st = svc.good.stats()["shards"][shard]
    files = {}
    d = svc.dd.shard_dir(shard)
    for name in sorted(os.listdir(d)):
        if name.endswith((".wal", ".ckpt")):
            files[name] = os.path.getsize(os.path.join(d, name))
    totals = {q: sum(v for k, v in c.items() if k != "keys") for q, c in st["queues"].items()}
    return {"jobs": st["jobs"], "wal_bytes": st["wal_bytes"], "queues": totals, "files": files}


def assert_serving(svc):
    assert svc.good.ping() == svc.pids, "a shard restarted: " + svc.tail()


# ---------------------------------------------------------------- the generator
TEMPLATES = {
    "put_result": [1 << 10, 1, b"value", 60.0],
    "progress": [1 << 10, 1, 0.5, "note"],
    "result": [[1 << 10, 2 << 10]],
    "result_sizes": [[1 << 10, 2 << 10]],
    "arrive": ["fz.b", 0, 2, b"value", 60.0, [b"cb", "fz-key", "fuzzq", 0, 0]],
    "arrive_many": [[["fz.d", 0, 2, b"value", 60.0, [b"cb", "fz-key", "fuzzq", 0, 0]],
                     ["fz.d", 1, 2, b"value", 60.0, [b"cb", "fz-key", "fuzzq", 0, 0]]]],
    "put_workflow": ["fz.w", b"spec"],
    "end_workflow": ["fz.w", "failed", "boom", 60.0],
    "workflow": ["fz.w"],
    "workflow_ids": [None, 10],
    "barrier": [["fz.b", "fz.c"]],
    "barrier_values": ["fz.b"],
    "cancel_barrier": ["fz.c", 60.0],
    "enqueue": [[[b"body", "fz-key", "default", 0, 0, None]], [7, 1, 1]],
    "dequeue": ["fuzzq", 5.0, 2],
    "peek": ["fuzzq", 2],
    "ack": [[[1 << 10, 1]]],
    "nack": [1 << 10, 1, 0, None, True],
    "bury": [1 << 10, 1, None],
    "extend": [1 << 10, 1, 5.0],
    "watch": ["fuzzq", 0.2],
    "dequeue_wait": ["fuzzq", 5.0, 2, 0.2],
    "cancel_wait": [1],
    "dead_letters": ["default", 10],
    "redrive": ["fuzzq", None],
    "purge_dead": ["fuzzq"],
    "purge_queue": ["fuzzp"],   # a queue of its own: the others' jobs stay for the checks below
    "queue_config": ["default"],
    "note_priorities": ["fuzzq"],
    "stats": [],
    "ping": [],
    "pause": ["fuzzq"],
    "resume": ["fuzzq"],
    "cancel": [(5 << 10) | 1],
    "job": [1 << 10],
    "dead_page": ["fuzzq", None, 10],
    "purge_ids": ["fuzzq", [1 << 10]],
    "metrics": [],
    "metrics_page": [0],
    "set_limits": ["fuzzq", {"concurrency": 2}],
    "backup_cut": ["backup-1-0f"],
}
assert set(TEMPLATES) == set(protocol.OPS)
assert all(len(TEMPLATES[op]) == protocol.ARITY[op] for op in TEMPLATES)

#: Request shapes with a known bug, skipped by the random frames (each with its own xfail
#: test) so the rest of the fuzzing keeps guarding. Empty: the NaN watch timeout this suite
#: found is fixed and has a regression test below.
KNOWN_BUGS: list = []


def value(rng: random.Random, depth: int = 0):
    k = rng.randrange(10 if depth < 3 else 7)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, 1, -1, 2**31, -2**31 - 1, 2**63 - 1, -2**63, 2**64 - 1, (5 << 10) | 1,
                           rng.randrange(-1000, 1000)])
    if k == 3:
        return rng.choice([0.0, -0.0, 1.5, -1.0, math.inf, -math.inf, math.nan, 1e300, rng.random() * 100])
    if k == 4:
        return "".join(rng.choice("ab\u00e9\u4e2d\x00 ") for _ in range(rng.randrange(0, 20)))
    if k == 5:
        return rng.randbytes(rng.randrange(0, 30))
    if k == 6:
        return rng.choice(["default", "", "x" * 200, "fuzzq", "k" * 600])
    if k in (7, 8):
        return [value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {rng.choice(["a", "b", 1]): value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


def _paths(x, p=()):
    if p:
        yield p
    if isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, p + (i,))


def _mutated_request(rng: random.Random, rid: int) -> list:
    """A valid request with one to three fields (at any depth) replaced by random values."""
    op = rng.choice(sorted(TEMPLATES))
    args = copy.deepcopy(TEMPLATES[op])
    for _ in range(rng.randrange(1, 4)):
        paths = list(_paths(args))
        if not paths:
            break
        where = rng.choice(paths)
        target = args
        for i in where[:-1]:
            target = target[i]
        target[where[-1]] = value(rng)
    if rng.random() < 0.1:
        args = args + [value(rng)] if rng.random() < 0.5 else args[:-1]  # wrong arity
    return [rid, op, args]


def frame(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 120))                       # random bytes
    if kind == 1:
        return msgpack.packb(value(rng))                                  # any msgpack value
    if kind == 2:                                                         # random op and args
        reqs = []
        for rid in range(1, rng.randrange(2, 5)):
            op = (rng.choice(sorted(protocol.OPS)) if rng.random() < 0.85
                  else rng.choice(["", "nope", "ENQUEUE", "x" * 99]))
            reqs.append([rid, op, [value(rng) for _ in range(protocol.ARITY.get(op, 2))]])
        return msgpack.packb(reqs)
    data = msgpack.packb([_mutated_request(rng, rid) for rid in range(1, rng.randrange(2, 4))])
    if kind == 4:                                                         # flipped, cut or grown bytes
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            how = rng.randrange(3)
            if how == 0:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif how == 1 and len(b) > 1:
                del b[rng.randrange(1, len(b)):]
            elif how == 2:
                at = rng.randrange(len(b))
                b[at:at + rng.randrange(0, 3)] = rng.randbytes(rng.randrange(1, 8))
        data = bytes(b)
    return data


def requests_in(data: bytes) -> list | None:
    """The requests if ``data`` is a well-formed batch (what the shard will answer), else None."""
    try:
        return protocol.decode_requests(data)
    except ProtocolError:
        return None


def _rejected(reply, reqs) -> bool:
    """True if nothing in the frame was accepted (so nothing may have changed)."""
    if reply == "closed":
        return True
    if not isinstance(reply, list):
        return False
    for rid, status, payload in reply:
        if status == protocol.OK:
            op = next((r[1] for r in reqs or [] if r[0] == rid), None)
            if op in ("stats", "ping", "queue_config", "dead_letters", "job", "dead_page", "metrics", "metrics_page") \
                    or (op == "dequeue" and payload == []) \
                    or (op == "ack" and all(e is not None for e in payload)) \
                    or (op in ("redrive", "purge_dead", "purge_ids", "purge_queue") and payload == 0) \
                    or (op in ("pause", "resume") and payload is False) or (op == "cancel" and payload == "gone"):
                continue
            return False
    return True


# ---------------------------------------------------------------- tests
def test_random_and_mutated_frames(svc):
    rng = random.Random(SEED)
    counts = {"reply": 0, "closed": 0, "deferred": 0}
    for n in range(FRAMES):
        data = frame(rng)
        reqs = requests_in(data)
        if reqs and any(isinstance(r, list) and len(r) == 3 and isinstance(r[2], list) and bug(r[1], r[2])
                        for r in reqs for _, bug in KNOWN_BUGS):
            continue
        shard = rng.randrange(2)
        before = fingerprint(svc, shard)
        conn = raw(svc, shard)
        try:
            # A batch of watches is answered later; an empty batch has nothing to answer.
            expect_reply = reqs is None or not all(r[1] in DEFERRED_OPS for r in reqs)
            reply = exchange(conn, data, REPLY_S if expect_reply else 0.3)
        finally:
            conn.close()
        where = f"seed {SEED}, frame {n}: {data[:120]!r}"
        if reply is None:
            assert reqs is not None and all(r[1] in DEFERRED_OPS for r in reqs), f"no reply and no disconnect; {where}"
            counts["deferred"] += 1
        elif reply == "closed":
            counts["closed"] += 1
        else:
            counts["reply"] += 1
            assert isinstance(reply, list), where
            for r in reply:
                assert len(r) == 3 and r[1] in (protocol.OK, protocol.ERR), where
                if r[1] == protocol.ERR:
                    assert isinstance(r[2], list) and len(r[2]) == 2 and isinstance(r[2][0], str), where
        assert_serving(svc)
        if _rejected(reply, reqs):
            assert fingerprint(svc, shard) == before, f"a rejected frame changed the shard; {where} -> {reply!r:.300}"
    assert counts["reply"] > FRAMES // 5 and counts["closed"] > FRAMES // 5, counts
    for name in ("default", "fuzzq"):  # a random frame may have paused one: the next tests lease
        svc.good.resume(name)


OTHER = (10**9 << 10) | 1   # a job id of shard 1
MINE = 10**9 << 10          # a job id of shard 0 that was never enqueued

INVALID = [  # (request args, expected error) -- all sent to shard 0 in one frame
    ("nope", [], "ProtocolError"),
    ("", [1, 2], "ProtocolError"),
    ("enqueue", [[]], "ProtocolError"),                                       # arity
    ("dequeue", "not-a-list", "ProtocolError"),
    ("enqueue", ["items", None], "InvalidJob"),
    ("enqueue", [[], None], "InvalidJob"),                                    # empty batch
    ("enqueue", [[["str body", "k", "default", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"", "k", "default", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", 5, "default", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "", "default", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k" * 600, "default", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "", 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "q" * 200, 0, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", -1, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", math.nan, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", math.inf, 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", "5", 0, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", None, None, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, 2**31, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, 1.5, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, "", None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0.5, None, None]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, 0, ""]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, 0, "d" * 200]], None], "InvalidJob"),
    ("enqueue", [[[b"x", "k", "default", 0, 0]], None], "InvalidJob"),       # 5 fields
    ("enqueue", [[[b"ok", "k", "default", 0, 0, None], [b"x", "k", "default", -1, 0, None]], None],
     "InvalidJob"),                                                           # one bad item: none in
    ("enqueue", [[[b"x", "k", "default", 0, 0, None]], [1, 2]], "InvalidJob"),  # session shape
    ("enqueue", [[[b"x", "k", "default", 0, 0, None]], [-1, 2, 3]], "InvalidJob"),
    ("dequeue", ["default", 5.0, 0], "InvalidJob"),
    ("dequeue", ["default", 5.0, 10**6], "InvalidJob"),
    ("dequeue", ["", None, 1], "InvalidJob"),
    ("dequeue", [7, None, 1], "InvalidJob"),
    ("dequeue", ["default", 0, 1], "InvalidJob"),
    ("dequeue", ["default", -1.0, 1], "InvalidJob"),
    ("dequeue", ["default", math.nan, 1], "InvalidJob"),
    ("ack", ["pairs"], "InvalidJob"),
    ("nack", [OTHER, 1, 0, None, True], "NotFound"),                          # another shard's job id
    ("nack", [MINE, 1, 0, None, True], "JobGone"),
    ("nack", [MINE, 1, -5, None, "yes"], "InvalidJob"),
    ("nack", ["id", 1, 0, None, True], "InvalidJob"),
    ("extend", [OTHER, 1, 5.0], "NotFound"),
    ("extend", [MINE, 1, 0], "InvalidJob"),
    ("extend", [MINE, 1, math.nan], "InvalidJob"),
    ("extend", [-1, 1, 5.0], "InvalidJob"),
    ("watch", [7, 1.0], "InvalidJob"),
    ("watch", ["default", "soon"], "InvalidJob"),
    ("dequeue_wait", [7, None, 1, 1.0], "InvalidJob"),
    ("dequeue_wait", ["default", None, 1, "soon"], "InvalidJob"),
    ("dequeue_wait", ["default", None, 1, math.nan], "InvalidJob"),
    ("dequeue_wait", ["default", None, 1, math.inf], "InvalidJob"),
    ("dead_letters", ["default", -1], "InvalidJob"),
    ("dead_letters", ["", 10], "InvalidJob"),
    ("redrive", ["default", "all"], "InvalidJob"),
    ("redrive", ["default", [OTHER]], "NotFound"),
    ("redrive", ["default", [-3]], "InvalidJob"),
    ("purge_dead", [""], "InvalidJob"),
    ("purge_queue", [""], "InvalidJob"),
    ("purge_queue", [["x"]], "ProtocolError"),
    ("queue_config", [""], "InvalidJob"),
    ("queue_config", [[1]], "ProtocolError"),
    ("pause", [""], "InvalidJob"),
    ("resume", [7], "InvalidJob"),
    ("cancel", ["id"], "InvalidJob"),
    ("cancel", [OTHER], "NotFound"),
    ("job", [MINE], "NotFound"),
    ("job", [OTHER], "NotFound"),
    ("dead_page", ["default", "x", 10], "InvalidJob"),
    ("dead_page", ["default", None, 1001], "InvalidJob"),
    ("purge_ids", ["default", "all"], "InvalidJob"),
    ("purge_ids", ["default", [-1]], "InvalidJob"),
    ("metrics", [1], "ProtocolError"),
    ("metrics_page", [], "ProtocolError"),
    ("metrics_page", [-1], "InvalidJob"),
]


def _seed_state(svc):
    """Give shard 0 jobs, a lease and a dead-letter-free queue, so 'unchanged' means something."""
    keys = [k for k in (f"seed-{i}" for i in range(200)) if shard_for_key(k, 2) == 0][:5]
    svc.good.enqueue_many([{"body": f"seed {k} {i}".encode(), "key": k} for k in keys for i in range(3)])
    assert svc.good.dequeue(visibility=600, wait=2) is not None


def test_invalid_requests_get_typed_errors_and_change_nothing(svc):
    _seed_state(svc)
    before = svc.good.stats()["shards"][0]
    fp = fingerprint(svc, 0)
    conn = raw(svc, 0)
    try:
        reqs = [[i + 1, op, args] for i, (op, args, _) in enumerate(INVALID)]
        reply = exchange(conn, msgpack.packb(reqs))
        assert isinstance(reply, list) and len(reply) == len(INVALID), reply
        got = {rid: (status, payload) for rid, status, payload in reply}
        wrong = []
        for i, (op, args, expected) in enumerate(INVALID):
            status, payload = got[i + 1]
            if status != protocol.ERR or payload[0] != expected:
                wrong.append((op, args, expected, status, payload))
        assert not wrong, "\n".join(map(repr, wrong))
        # ack errors come per pair, the request itself succeeds
        pairs = [[OTHER, 1], [MINE, 1], ["x", 1], [MINE], [MINE, -1]]
        (_, status, payload), = exchange(conn, msgpack.packb([[99, "ack", [pairs]]]))
        assert status == protocol.OK
        assert [p[0] for p in payload] == ["NotFound", "JobGone", "InvalidJob", "InvalidJob", "InvalidJob"]
        assert exchange(conn, msgpack.packb([[100, "ping", []]])) == [[100, protocol.OK, svc.pids[0]]]
    finally:
        conn.close()
    after = svc.good.stats()["shards"][0]
    assert fingerprint(svc, 0) == fp
    volatile = ("iterations", "clients")
    assert {k: v for k, v in after.items() if k not in volatile} == \
           {k: v for k, v in before.items() if k not in volatile}
    assert_serving(svc)


def _raw_socket(svc, shard=0) -> socket.socket:
    """An authenticated connection as a plain socket, to write arbitrary bytes."""
    conn = raw(svc, shard)
    s = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    s.settimeout(REPLY_S)
    return s


def _closed_by_shard(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("header", [
    struct.pack("!i", 1 << 30),                          # 1 GiB announced
    struct.pack("!i", -1) + struct.pack("!Q", 1 << 62),  # 64-bit length form, absurd
    struct.pack("!i", -7),                                # negative length
], ids=["1GiB", "len64", "negative"])
def test_oversized_length_header_is_refused_before_allocation(svc, header):
    fp = fingerprint(svc, 0)
    s = _raw_socket(svc)
    try:
        s.sendall(header + b"\x91\x93\x01\xa4ping\x90")
        assert _closed_by_shard(s), "the shard kept a connection that announced an impossible frame"
    finally:
        s.close()
    assert_serving(svc)
    assert fingerprint(svc, 0) == fp


def test_huge_length_then_close_and_truncated_frames(svc):
    fp = fingerprint(svc, 0)
    good = msgpack.packb([[1, "enqueue", [[[b"never", "trunc", "default", 0, 0, None]], None]]])
    for payload in (struct.pack("!i", 1 << 30),                         # 1 GiB announced, then close
                    struct.pack("!i", len(good)) + good[:-3],           # one byte short... then close
                    struct.pack("!i", 50_000_000) + b"\x00" * 1000,     # large but legal, then close
                    struct.pack("!i", len(good))[:2]):                  # half a header
        s = _raw_socket(svc)
        s.sendall(payload)
        s.close()
    assert_serving(svc)
    assert fingerprint(svc, 0) == fp


def test_stalled_mid_frame_does_not_block_other_clients(svc):
    s = _raw_socket(svc)
    try:
        s.sendall(struct.pack("!i", 1000) + b"\x91")  # and then nothing
        for _ in range(20):
            assert_serving(svc)                        # served while the stalled frame waits
        jid = svc.good.enqueue(b"while stalled", key="stall", queue="stallq")
        lease = svc.good.dequeue("stallq", wait=2)
        assert lease is not None and lease.job_id == jid
        svc.good.ack(lease)
    finally:
        s.close()
    assert_serving(svc)


def _peer_hung_up(s: socket.socket) -> bool:
    """The shard shut the connection down (POLLRDHUP shows it even with replies unread)."""
    p = select.poll()
    p.register(s, select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))


def test_client_that_never_reads_replies_is_dropped(svc):
    s = _raw_socket(svc)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        reqs = msgpack.packb([[i, "stats", []] for i in range(1, limits.FRAME_REQUESTS_MAX + 1)])  # MBs of replies
        s.sendall(struct.pack("!i", len(reqs)) + reqs)
        def dropped():
            assert_serving(svc)  # the others are served while the shard waits on this client
            return _peer_hung_up(s)
        wait_until(dropped, timeout=20, what="the shard to drop a client that does not read")
        announced = struct.unpack("!i", s.recv(4, socket.MSG_WAITALL))[0]
        got = 0
        while chunk := s.recv(1 << 20):
            got += len(chunk)
        assert got < announced, "the shard was expected to give up on this client mid-reply"
        assert_serving(svc)
    finally:
        s.close()


def test_connection_flood_without_auth(svc):
    socks = []
    try:
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(svc.dd.socket_path(0))
            except OSError:
                s.close()
                continue
            socks.append(s)
        # The router connected before the flood keeps being served.
        for _ in range(10):
            assert_serving(svc)
        jid = svc.good.enqueue(b"during flood", key="flood", queue="floodq")
        lease = svc.good.dequeue("floodq", wait=2)
        assert lease is not None and lease.job_id == jid
        svc.good.ack(lease)
    finally:
        for s in socks:
            s.close()
    # Once the flood is gone, a new client gets in (handshake slots are released).
    def new_client_ok():
        try:
            with svc.connect(retry_s=1, request_timeout_s=2) as q:
                return q.ping() == svc.pids
        except ShardqError:
            return False
    wait_until(new_client_ok, timeout=20, what="a new client to connect after the flood")


def test_wrong_key_is_refused(svc):
    for _ in range(20):
        with pytest.raises((AuthenticationError, EOFError, OSError)):
            Client(svc.dd.socket_path(0), family="AF_UNIX", authkey=b"w" * 64)
    assert_serving(svc)


def test_rejected_enqueue_leaves_no_phantom_job(svc):
    """A falsy non-integer priority once slipped past validation and left a job in memory
    that was never logged (fixed in 26716ba; kept as a regression test)."""
    fp = fingerprint(svc, 0)
    conn = raw(svc, 0)
    try:
        for prio in (None, "", [], b""):
            for delay in (0, 0.3):
                reply = exchange(conn, msgpack.packb([[1, "enqueue", [[[b"x", "phantom", "default", delay, prio,
                                                                         None]], None]]]))
                assert reply[0][1] == protocol.ERR, reply
    finally:
        conn.close()
    assert fingerprint(svc, 0) == fp
    assert_serving(svc)


def test_watch_with_a_non_finite_timeout_is_refused_and_the_shard_lives(svc):
    """Found by this suite: a NaN timeout reached the shard's selector, which raised and
    took the shard process down. Now refused as InvalidJob."""
    conn = raw(svc, 0)
    try:
        for t in (math.nan, math.inf, -math.inf):
            (_, status, payload), = exchange(conn, msgpack.packb([[1, "watch", ["nanq", t]]]), wait=REPLY_S)
            assert status == protocol.ERR and payload[0] == "InvalidJob"
    finally:
        conn.close()
    assert_serving(svc)


def test_watch_refuses_a_queue_name_dequeue_refuses_and_the_error_stays_small(svc):
    """Found by a walkthrough: watch took any string as its queue (a 10 MB one parked in the
    shard's memory for the whole wait) where dequeue refuses one over 128 bytes."""
    top = limits.QUEUE_NAME_BYTES_MAX
    conn = raw(svc, 0)
    try:
        (_, status, payload), = exchange(conn, msgpack.packb([[1, "watch", ["w" * top, 0]]]), wait=REPLY_S)
        assert (status, payload) == (protocol.OK, False)  # at the limit: watched, nothing ready
        for name in ("", "w" * (top + 1), "w" * 10_000_000):
            (_, status, payload), = exchange(conn, msgpack.packb([[2, "watch", [name, 0]]]), wait=REPLY_S)
            assert status == protocol.ERR and payload[0] == "InvalidJob" and len(payload[1]) < 400, payload[:1]
    finally:
        conn.close()
    assert_serving(svc)


def test_dequeue_validates_visibility_even_on_an_unused_queue(svc):
    """Regression: the check once came after the early return for a never-used queue."""
    conn = raw(svc, 0)
    try:
        for vis in (math.nan, 0, -1.0):
            (_, status, payload), = exchange(conn, msgpack.packb([[1, "dequeue", ["never-used-q", vis, 1]]]))
            assert status == protocol.ERR and payload[0] == "InvalidJob", (vis, payload)
    finally:
        conn.close()
