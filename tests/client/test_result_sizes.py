"""``results(ids, sizes=True)`` on both client drivers against real shard processes: each
kept result's length (``value_bytes``) from one ``result_sizes`` request per shard, never a value, also
for more maximal results than one reply holds (where ``results`` withholds values and
asks for each again alone); and a workflow's ``status()`` reads only sizes."""
from __future__ import annotations

import asyncio

import pytest

import shardq
from shardq import limits
from shardq.client.effects import Send, Submit
from shardq.client.routing import job_shard, shard_for_key
from support.service import Service

SHARDS = 2
N = limits.REPLY_BYTES_MAX // limits.RESULT_BYTES_MAX + 2  # more than one reply holds, per shard


@pytest.fixture(scope="module")
def kept():
    """A service whose every shard keeps N maximal results (and one job still ready)."""
    with Service(shards=SHARDS, config={"queue_defaults": {"visibility_timeout": 60}}) as svc:
        with svc.connect() as q:
            keys = {shard: [k for k in (f"k{i}" for i in range(20 * N)) if shard_for_key(k, SHARDS) == shard][:N]
                    for shard in range(SHARDS)}
            ids = q.enqueue_many([{"body": b"x", "key": k} for shard in keys for k in keys[shard]])
            assert sorted(job_shard(j, SHARDS) for j in ids) == sorted(list(range(SHARDS)) * N)
            leases = []
            while len(leases) < len(ids):
                leases += q.dequeue_many(max_jobs=100, wait=1)
            sizes = {}
            for i, lease in enumerate(leases):
                size = limits.RESULT_BYTES_MAX - i
                q.put_result(lease, bytes([i % 256]) * size, 3600.0)
                sizes[lease.job_id] = size
            q.ack_many(leases)
            ready = q.enqueue(b"not run yet")
        yield svc, ids, sizes, ready


def _ops(calls) -> list[str]:
    return [op for _shard, op, _args in calls]


def test_the_threaded_router_reads_every_size_in_one_request_per_shard(kept, monkeypatch):
    svc, ids, sizes, ready = kept
    with svc.connect() as q:
        sent: list[str] = []
        send = q._handlers[Send]  # each Send's calls (a lone one, or those deliver transmits)
        monkeypatch.setitem(q._handlers, Send, lambda e: sent.extend(_ops(e.calls)) or send(e))
        got = q.results(ids + [ready], sizes=True)
        assert [r.value_bytes for r in got[:-1]] == [sizes[j] for j in ids]
        assert {r.state for r in got[:-1]} == {"succeeded"} and got[-1].state == "ready"
        assert {r.value for r in got} == {None} and got[-1].value_bytes is None
        assert sent == ["result_sizes"] * SHARDS
        sent.clear()
        values = q.results(ids)  # values as before: bytes, the withheld ones asked for alone
        assert [len(r.value) for r in values] == [r.value_bytes for r in values] == [sizes[j] for j in ids]
        assert set(sent) == {"result"} and len(sent) > SHARDS


def test_the_asyncio_client_reads_the_same_sizes(kept):
    svc, ids, sizes, ready = kept

    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            sent: list[str] = []
            submit = q._handlers[Submit]

            async def counted(effect):  # each request, sent once
                sent.extend(_ops(effect.calls))
                return await submit(effect)
            q._handlers[Submit] = counted
            got = await q.results(ids + [ready], sizes=True)
            return got, sent

    got, sent = asyncio.run(main())
    assert [r.value_bytes for r in got[:-1]] == [sizes[j] for j in ids] and got[-1].state == "ready"
    assert {r.value for r in got} == {None}
    assert sent == ["result_sizes"] * SHARDS


@pytest.mark.parametrize("entry", [["succeeded", b"bytes", None, None, None, None, 1.0, False],
                                   ["succeeded", -1, None, None, None, None, 1.0, False],
                                   ["succeeded", True, None, None, None, None, 1.0, False],
                                   ["succeeded", 5, None]])
def test_a_malformed_size_entry_is_a_protocol_error(entry):
    from shardq.client import results as res
    with pytest.raises(shardq.ProtocolError, match="malformed"):
        res.job_result(7, entry, sizes=True)
