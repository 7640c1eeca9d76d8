"""Bad input to the asyncio client (issue 32, section 6), as tests/protocol/test_fuzz_protocol.py
does for the shard wire: Hypothesis draws a call of ``shardq.aio`` with one argument made
wrong (a wrong type, a value out of range, a size past its limit, a lease that is no lease
of this service) and the rest right.

Each such call must fail with a typed shardq error, before anything is sent or as the
shard's refusal, and change nothing: the shards' jobs and logs are as before, no shard
process was replaced, and a normal enqueue, dequeue and ack still work. Every limit is also
taken at its maximum (accepted) and one past it (refused, or cut where the client cuts).

``SHARDQ_FUZZ_EXAMPLES`` sets the examples per property (default 120; e.g. 3000 for a long run).
"""
from __future__ import annotations

import asyncio
import gc
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardq
from shardq import limits
from shardq.errors import InvalidJob, ShardqError, ShardUnavailable
from shardq.types import Lease

from support.service import Service

EXAMPLES = int(os.environ.get("SHARDQ_FUZZ_EXAMPLES", "120"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BODY_MAX = limits.BODY_BYTES_MAX_DEFAULT
CEILING = limits.BODY_BYTES_MAX_CEILING
CONFIG = {"queues": {"ceiling": {"max_body_bytes": CEILING}, "held": {"visibility_timeout": 3600},
                     "cycle": {}, "limits": {}, "dead": {"max_deliveries": 1}}}
NOT_SERVED = (ShardUnavailable, shardq.Closed)  # errors that would mean the client or service broke


class Client:
    """One AsyncQueue on one event loop for the whole module (connecting per example would
    cost more than the examples)."""

    def __init__(self, svc: Service):
        self.svc = svc
        self.runner = asyncio.Runner()
        self.q = self.run(shardq.aio.connect(svc.data_dir, retry_s=5, request_timeout_s=10))
        self.pids = self.run(self.q.ping())
        self.run(self.q.enqueue(b"held", key="h", queue="held"))
        self.lease = self.run(self.q.dequeue("held"))
        assert self.lease is not None

    def run(self, coro, timeout: float = 30.0):
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def fingerprint(self) -> list:
        """What a refused call must not change: per shard, its jobs and its log's bytes."""
        return [(sh["jobs"], sh["wal_bytes"]) for sh in self.run(self.q.stats())["shards"]]

    def still_serving(self) -> None:
        """The same shard processes answer, and a job goes through."""
        q = self.q
        assert self.run(q.ping()) == self.pids
        jid = self.run(q.enqueue(b"ok", key="cycle", queue="cycle"))
        lease = self.run(q.dequeue("cycle", wait=5))
        assert lease is not None and lease.job_id == jid
        self.run(q.ack(lease))

    def close(self) -> None:
        self.run(self.q.close())
        self.runner.close()


@pytest.fixture(scope="module")
def client():
    with Service(shards=2, config=CONFIG) as svc:
        c = Client(svc)
        try:
            yield c
        finally:
            c.close()


def refused(client: Client, call) -> ShardqError:
    """Make ``call(q)`` (a coroutine, or a plain value for ``consume``); assert it fails with a
    typed error that names the caller's input, and that nothing changed."""
    before = client.fingerprint()

    async def attempt():
        got = call(client.q)
        return await got if asyncio.iscoroutine(got) else await got.__anext__()

    with pytest.raises(ShardqError) as info:
        client.run(attempt())
    assert not isinstance(info.value, NOT_SERVED), info.value
    assert isinstance(info.value, InvalidJob), repr(info.value)  # the caller's input, typed
    assert client.fingerprint() == before
    return info.value


# ---------------------------------------------------------------------------- bad values
# Each strategy draws only values the client must refuse for that argument.
nan_inf = st.sampled_from([math.nan, math.inf, -math.inf])
not_number = st.one_of(st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2), st.just(True))
not_text = st.one_of(st.integers(), st.binary(max_size=5), st.lists(st.text(max_size=3), max_size=2),
                     st.floats(allow_nan=False), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
surrogate = st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
                      st.characters(codec=None, categories=["Cs"]), st.text(max_size=5))


def seconds(hi: float, zero_ok: bool = True):
    past = [math.nextafter(hi, math.inf), hi * 2, 1e300]
    below = [-1e-9, -1.0] + ([] if zero_ok else [0, 0.0])
    return st.one_of(nan_inf, st.sampled_from(past + below), st.text(max_size=4).filter(bool),
                     st.lists(st.integers(), max_size=1), st.just(True))


bad_body = st.one_of(st.just(b""), st.text(max_size=5), st.integers(), st.none(), st.lists(st.binary(), max_size=2),
                     st.integers(1, 64).map(lambda n: b"x" * (BODY_MAX + n)))
bad_key = st.one_of(not_text, st.just(""), surrogate,
                    st.sampled_from(["k" * (limits.KEY_BYTES_MAX + 1), "é" * (limits.KEY_BYTES_MAX // 2 + 1),
                                     "\U0001d11e" * (limits.KEY_BYTES_MAX // 4) + "k"]))
bad_queue = st.one_of(not_text, st.none(), st.just(""), surrogate,
                      st.sampled_from(["q" * (limits.QUEUE_NAME_BYTES_MAX + 1),
                                       "é" * (limits.QUEUE_NAME_BYTES_MAX // 2) + "q"]))
bad_priority = st.one_of(st.floats(), st.text(max_size=3), st.just(True), st.none(),
                         st.integers(limits.PRIORITY_MAX + 1, 2**70), st.integers(-(2**70), limits.PRIORITY_MIN - 1))
bad_dedup = st.one_of(st.just(""), st.just(b""), st.integers(), st.lists(st.text(max_size=2), max_size=1), surrogate,
                      st.sampled_from(["d" * (limits.DEDUP_ID_BYTES_MAX + 1), b"d" * (limits.DEDUP_ID_BYTES_MAX + 1),
                                       "é" * (limits.DEDUP_ID_BYTES_MAX // 2) + "d"]))
bad_count = st.one_of(st.integers(-5, 0), st.integers(limits.BATCH_JOBS_MAX + 1, 2**70), st.floats(), not_number)
bad_job_id = st.one_of(st.text(max_size=4), st.none(), st.floats(), st.just(True), st.integers(-(2**70), -1),
                       st.integers(2**63, 2**70), st.integers(2, 1023).map(lambda s: (7 << 10) | s))


def bad_lease(client: Client):
    good = client.lease
    return st.one_of(st.none(), st.text(max_size=4), st.integers(), st.tuples(st.integers(), st.integers()),
                     bad_job_id.map(lambda j: good._replace(job_id=j)),
                     st.one_of(st.text(max_size=4), st.none(), st.floats(), st.integers(-(2**70), -1))
                     .map(lambda t: good._replace(token=t)))


def client_bad_lease(client: Client):
    """Leases the client itself must refuse (not a Lease, a job id of no shard of it)."""
    good = client.lease
    return st.one_of(st.none(), st.text(max_size=4), st.integers(), bad_job_id.map(lambda j: good._replace(job_id=j)))


def job_dicts():
    """One job dict for enqueue_many with one field made wrong (or a wrong shape)."""
    good = {"body": b"x", "key": "k"}
    field = st.sampled_from([("body", bad_body), ("key", bad_key), ("queue", bad_queue),
                             ("delay", seconds(limits.DELAY_S_MAX)), ("priority", bad_priority),
                             ("dedup_id", bad_dedup)])
    one_field = field.flatmap(lambda f: f[1].map(lambda v, name=f[0]: {**good, name: v}))
    shape = st.one_of(st.just({"key": "k"}), st.just({**good, "bogus": 1}), not_text, st.none(),
                      st.just([b"x", "k"]))
    return st.one_of(one_field, shape)


def calls(client: Client):
    """(what, call) pairs: one method of the client with one argument made wrong."""
    lease = client.lease
    leases = bad_lease(client)
    enqueue = st.one_of(
        bad_body.map(lambda v: ("enqueue body", lambda q: q.enqueue(v))),
        bad_key.map(lambda v: ("enqueue key", lambda q: q.enqueue(b"x", key=v))),
        bad_queue.map(lambda v: ("enqueue queue", lambda q: q.enqueue(b"x", queue=v))),
        seconds(limits.DELAY_S_MAX).map(lambda v: ("enqueue delay", lambda q: q.enqueue(b"x", delay=v))),
        bad_priority.map(lambda v: ("enqueue priority", lambda q: q.enqueue(b"x", priority=v))),
        bad_dedup.map(lambda v: ("enqueue dedup_id", lambda q: q.enqueue(b"x", dedup_id=v))),
        st.tuples(st.lists(st.fixed_dictionaries({"body": st.binary(min_size=1, max_size=8),
                                                  "key": st.text(min_size=1, max_size=8)}), max_size=20),
                  job_dicts(), st.integers(0, 20))
        .map(lambda t: ("enqueue_many job", lambda q: q.enqueue_many(t[0][:t[2]] + [t[1]] + t[0][t[2]:]))),
        st.one_of(st.integers(), st.none(), st.floats())
        .map(lambda v: ("enqueue_many jobs", lambda q: q.enqueue_many(v))),
        bad_queue.map(lambda v: ("enqueue_many queue", lambda q: q.enqueue_many([{"body": b"x"}], queue=v))),
    )
    consume = st.one_of(
        bad_queue.map(lambda v: ("dequeue queue", lambda q: q.dequeue(v))),
        bad_count.map(lambda v: ("dequeue_many max_jobs", lambda q: q.dequeue_many("cycle", max_jobs=v))),
        seconds(limits.WAIT_S_MAX).filter(lambda v: v != 0).map(
            lambda v: ("dequeue wait", lambda q: q.dequeue("cycle", wait=v))),
        seconds(limits.VISIBILITY_TIMEOUT_S_MAX, zero_ok=False).map(
            lambda v: ("dequeue visibility", lambda q: q.dequeue("cycle", visibility=v))),
        bad_count.map(lambda v: ("consume concurrency", lambda q: q.consume("cycle", concurrency=v))),
    )
    settle = st.one_of(
        leases.map(lambda v: ("ack lease", lambda q: q.ack(v))),
        leases.map(lambda v: ("nack lease", lambda q: q.nack(v))),
        leases.map(lambda v: ("bury lease", lambda q: q.bury(v))),
        leases.map(lambda v: ("extend lease", lambda q: q.extend(v, 10))),
        # with the held lease first: a lease the client can tell is none fails the whole call
        # before anything is sent (a bad token is the shard's to find: a per-lease error)
        st.one_of(st.lists(client_bad_lease(client), min_size=1, max_size=3).map(lambda ls: [lease] + ls),
                  st.integers(), st.none())
        .map(lambda v: ("ack_many leases", lambda q: q.ack_many(v))),
        seconds(limits.DELAY_S_MAX).map(lambda v: ("nack delay", lambda q: q.nack(lease, delay=v))),
        not_text.map(lambda v: ("nack error", lambda q: q.nack(lease, error=v))),
        not_text.map(lambda v: ("bury error", lambda q: q.bury(lease, error=v))),
        seconds(limits.VISIBILITY_TIMEOUT_S_MAX, zero_ok=False).map(
            lambda v: ("extend seconds", lambda q: q.extend(lease, v))),
    )
    admin = st.one_of(
        bad_queue.map(lambda v: ("dead_letters queue", lambda q: q.dead_letters(v))),
        st.one_of(st.integers(-(2**70), -1), st.integers(2**64, 2**70), st.floats(), st.text(max_size=3).filter(bool))
        .map(lambda v: ("dead_letters limit", lambda q: q.dead_letters("dead", limit=v))),
        bad_queue.map(lambda v: ("redrive queue", lambda q: q.redrive(v))),
        st.one_of(st.text(max_size=3), st.integers(), st.lists(bad_job_id, min_size=1, max_size=3))
        .map(lambda v: ("redrive job_ids", lambda q: q.redrive("dead", job_ids=v))),
        bad_queue.map(lambda v: ("purge queue", lambda q: q.purge_dead_letters(v))),
        st.one_of(st.text(max_size=3), st.integers(), st.lists(bad_job_id, min_size=1, max_size=3))
        .map(lambda v: ("purge job_ids", lambda q: q.purge_dead_letters("dead", job_ids=v))),
        bad_queue.map(lambda v: ("queue_config queue", lambda q: q.queue_config(v))),
    )
    return st.one_of(enqueue, consume, settle, admin)


@pytest.fixture(scope="module")
def call_strategy(client):
    return calls(client)


@fuzz
@given(data=st.data())
def test_a_bad_argument_is_refused_typed_and_changes_nothing(client, call_strategy, data):
    what, call = data.draw(call_strategy, label="call")
    err = refused(client, call)
    assert str(err), what
    client.still_serving()
    assert client.run(client.q.extend(client.lease, 3600)).job_id == client.lease.job_id  # the held lease too


# ---------------------------------------------------------------------------- each limit at its maximum and one past
def _next(x: float) -> float:
    return math.nextafter(x, math.inf)


KEY_ASCII, KEY_WIDE = "k" * limits.KEY_BYTES_MAX, "\U0001d11e" * (limits.KEY_BYTES_MAX // 4)
QUEUE_ASCII, QUEUE_WIDE = "q" * limits.QUEUE_NAME_BYTES_MAX, "é" * (limits.QUEUE_NAME_BYTES_MAX // 2)
DEDUP = "d" * limits.DEDUP_ID_BYTES_MAX

# (name, the call at the limit, the call one past it); the call at the limit must succeed.
LIMITS = [
    ("body", lambda q: q.enqueue(b"b" * BODY_MAX, queue="limits"), lambda q: q.enqueue(b"b" * (BODY_MAX + 1))),
    ("body ceiling", lambda q: q.enqueue(b"c" * CEILING, queue="ceiling"),
     lambda q: q.enqueue(b"c" * (CEILING + 1), queue="ceiling")),
    ("key", lambda q: q.enqueue(b"x", key=KEY_ASCII, queue="limits"), lambda q: q.enqueue(b"x", key=KEY_ASCII + "k")),
    ("key in 4-byte characters", lambda q: q.enqueue(b"x", key=KEY_WIDE, queue="limits"),
     lambda q: q.enqueue(b"x", key=KEY_WIDE + "k")),
    ("queue name", lambda q: q.enqueue(b"x", queue=QUEUE_ASCII), lambda q: q.enqueue(b"x", queue=QUEUE_ASCII + "q")),
    ("queue name in 2-byte characters", lambda q: q.enqueue(b"x", queue=QUEUE_WIDE),
     lambda q: q.enqueue(b"x", queue=QUEUE_WIDE + "q")),
    ("dedup id", lambda q: q.enqueue(b"x", dedup_id=DEDUP, queue="limits"),
     lambda q: q.enqueue(b"x", dedup_id=DEDUP + "d")),
    ("dedup id bytes", lambda q: q.enqueue(b"x", dedup_id=DEDUP.encode(), queue="limits"),
     lambda q: q.enqueue(b"x", dedup_id=DEDUP.encode() + b"d")),
    ("priority max", lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MAX, queue="limits"),
     lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MAX + 1)),
    ("priority min", lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MIN, queue="limits"),
     lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MIN - 1)),
    ("delay", lambda q: q.enqueue(b"x", delay=limits.DELAY_S_MAX, queue="limits"),
     lambda q: q.enqueue(b"x", delay=_next(limits.DELAY_S_MAX))),
    ("max_jobs", lambda q: q.dequeue_many("limits", max_jobs=limits.BATCH_JOBS_MAX),
     lambda q: q.dequeue_many("limits", max_jobs=limits.BATCH_JOBS_MAX + 1)),
    ("wait", lambda q: q.dequeue("limits", wait=limits.WAIT_S_MAX),
     lambda q: q.dequeue("limits", wait=_next(limits.WAIT_S_MAX))),
    ("visibility", lambda q: q.dequeue("limits", visibility=limits.VISIBILITY_TIMEOUT_S_MAX),
     lambda q: q.dequeue("limits", visibility=_next(limits.VISIBILITY_TIMEOUT_S_MAX))),
    ("concurrency", lambda q: first_of(q.consume("limits", concurrency=limits.BATCH_JOBS_MAX)),
     lambda q: q.consume("limits", concurrency=limits.BATCH_JOBS_MAX + 1)),
]


async def first_of(leases) -> Lease:
    """The first lease a consume() loop yields; the loop is closed after it."""
    try:
        return await leases.__anext__()
    finally:
        await leases.aclose()


@pytest.mark.parametrize("name, at_max, one_past", LIMITS, ids=[x[0] for x in LIMITS])
def test_each_limit_at_its_maximum_is_taken_and_one_past_is_refused(client, name, at_max, one_past):
    q = client.q
    if name in ("max_jobs", "wait", "visibility", "concurrency"):  # a job to lease, so nothing waits
        client.run(q.enqueue(b"ready", queue="limits"))
    got = client.run(at_max(q))
    assert got is not None
    leases = got if isinstance(got, list) else [got] if isinstance(got, Lease) else []
    if leases:
        assert client.run(q.ack_many(leases)) == [None] * len(leases)
    assert "lone surrogate" not in str(refused(client, one_past))
    client.still_serving()


def test_settle_limits_at_their_maximum_and_one_past(client):
    q = client.q
    client.run(q.enqueue(b"settle", queue="settle"))
    lease = client.run(q.dequeue("settle"))
    lease = client.run(q.extend(lease, limits.VISIBILITY_TIMEOUT_S_MAX))
    refused(client, lambda q: q.extend(lease, _next(limits.VISIBILITY_TIMEOUT_S_MAX)))
    refused(client, lambda q: q.nack(lease, delay=_next(limits.DELAY_S_MAX)))
    client.run(q.nack(lease, delay=limits.DELAY_S_MAX))
    assert client.run(q.stats())["queues"]["settle"]["delayed"] == 1
    # An error past its limit is cut, not refused: it is the text of someone else's failure.
    client.run(q.enqueue(b"bury me", queue="settle"))
    lease = client.run(q.dequeue("settle"))
    client.run(q.bury(lease, "é" * limits.ERROR_TEXT_BYTES_MAX))
    [dead] = client.run(q.dead_letters("settle"))
    assert dead.error == "é" * (limits.ERROR_TEXT_BYTES_MAX // 2)
    client.still_serving()


def test_a_batch_one_past_the_job_limit_is_cut_not_refused(client):
    jobs = [{"body": b"j", "key": f"k{i % 7}"} for i in range(limits.BATCH_JOBS_MAX + 1)]
    ids = client.run(client.q.enqueue_many(jobs, queue="batch"))
    assert len(ids) == len(set(ids)) == limits.BATCH_JOBS_MAX + 1
    assert client.run(client.q.purge_dead_letters("batch")) == 0
    client.still_serving()


def test_purge_of_ids_at_the_shards_limit_and_one_past(client):
    """A shard takes BATCH_JOBS_MAX ids a request; one more goes in a second request (it
    was refused, after any other shard had purged its part)."""
    on_shard_0 = [(i << 10) for i in range(1, limits.BATCH_JOBS_MAX + 1)]
    assert client.run(client.q.purge_dead_letters("dead", on_shard_0)) == 0
    assert client.run(client.q.purge_dead_letters("dead", on_shard_0 + [(limits.BATCH_JOBS_MAX + 1) << 10])) == 0


# ---------------------------------------------------------------------------- found by the fuzz
@pytest.mark.parametrize("method", ["ack", "nack", "bury", "extend", "ack_many"])
@pytest.mark.parametrize("lease", ["not a lease", None, "shard 1023", "job id -1", "job id text"])
def test_a_lease_of_no_shard_of_this_service_is_invalid_job(client, method, lease):
    """These were an IndexError (self.conns[1023]), a TypeError or an AttributeError from
    inside the client, not a shardq error."""
    good = client.lease
    value = {"not a lease": "not a lease", None: None, "shard 1023": good._replace(job_id=(5 << 10) | 1023),
             "job id -1": good._replace(job_id=-1), "job id text": good._replace(job_id="5")}[lease]
    args = {"extend": (value, 10), "ack_many": ([value],)}.get(method, (value,))
    refused(client, lambda q: getattr(q, method)(*args))


@pytest.mark.parametrize("call", [lambda q: q.enqueue_many(None), lambda q: q.enqueue_many(5),
                                  lambda q: q.ack_many(None), lambda q: q.dequeue(["a", "list"]),
                                  lambda q: q.queue_config(["a", "list"])],
                         ids=["enqueue_many None", "enqueue_many 5", "ack_many None", "dequeue list",
                              "queue_config list"])
def test_what_is_not_a_list_or_not_a_queue_name_is_invalid_job(client, call):
    """A TypeError before (not iterable; unhashable in the client's per-queue sets)."""
    refused(client, call)


def test_a_refused_call_of_several_shards_leaves_no_unretrieved_error(client):
    """dead_letters asks every shard; the first refusal was raised and the second shard's
    left in its future, which asyncio reported as "Future exception was never retrieved"."""
    reported = []
    loop = client.runner.get_loop()
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        refused(client, lambda q: q.dead_letters("dead", limit="x"))
        gc.collect()
        client.run(asyncio.sleep(0))
    finally:
        loop.set_exception_handler(old)
    assert reported == []


def test_a_falsy_nack_delay_or_wait_that_is_no_number_is_refused(client):
    """The shard reads a falsy delay as 0 and the client took a falsy wait for none: a nack
    with ``delay=[]`` released the lease at once instead of being refused."""
    for delay in ([], "", {}, False):
        refused(client, lambda q: q.nack(client.lease, delay=delay))
    for wait in ([], "", False):
        refused(client, lambda q: q.dequeue("cycle", wait=wait))
    assert client.run(client.q.extend(client.lease, 3600)).job_id == client.lease.job_id  # still held


def test_one_callers_bad_queue_name_fails_only_its_own_enqueue(client):
    """Single enqueues of one event-loop turn go to their shard as one request; a bad one
    among them fails alone (the client checks it first; aioconn re-sends a refused merge
    call by call)."""
    async def both():
        return await asyncio.gather(client.q.enqueue(b"bad", key="same", queue=QUEUE_ASCII + "q"),
                                    client.q.enqueue(b"good", key="same", queue="merged"),
                                    return_exceptions=True)
    bad, good = client.run(both())
    assert isinstance(bad, InvalidJob) and isinstance(good, int), (bad, good)


def test_a_batch_with_one_bad_queue_name_enqueues_nothing_on_any_shard(client):
    """The name's length was left to the shard: the other shard's part of the batch went in."""
    keys = {shardq.client.routing.shard_for_key(f"k{i}", 2): f"k{i}" for i in range(10)}
    jobs = [{"body": b"a", "key": keys[0]}, {"body": b"b", "key": keys[1], "queue": "é" * 65}]
    refused(client, lambda q: q.enqueue_many(jobs, queue="batch-bad"))


@pytest.mark.parametrize("call", [lambda q: q.redrive(["q"]), lambda q: q.purge_dead_letters(["q"]),
                                  lambda q: q.dead_letters(["q"])], ids=["redrive", "purge", "dead_letters"])
def test_a_queue_that_is_no_string_is_invalid_job_not_a_protocol_error(client, call):
    refused(client, call)
