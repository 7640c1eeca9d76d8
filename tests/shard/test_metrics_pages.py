"""A scrape's ``metrics`` in pages (``metrics_page``: shardq/protocol/wire.py,
shardq/shard/control_handlers.py) and the client that reads them (``shard_metrics``).

At ``limits.QUEUES_MAX`` queues with 128-byte names and every limit, the one ``metrics``
reply was about 69 MB, over the frame limit: the client refused it and ``/metrics`` showed
the shard down with no queue series (the end-to-end check at the maximum is
tests/service/test_metrics_at_max.py). A page holds the queues from a position in the
order the shard made them, up to a byte budget, and says where the next one starts."""
from __future__ import annotations

import os
import time

import pytest

from shardq import limits
from shardq.protocol import wire
from shardq.shard import control_handlers as ch
from shardq.shard.durable import DurableShard
from shardq.shard.process import ShardServer

from support.fake_shard import Refuse

#: Every limit a queue may declare (docs/limits.md), for every queue of these tests.
EVERY_LIMIT = dict(concurrency=10, rate="25/s", burst=30, group_separator="/", group_concurrency=2,
                   group_rate="5/s", fair=True)
NOW = 1_000_000.0


def long_name(i: int) -> str:
    """A queue name at QUEUE_NAME_BYTES_MAX bytes; every seventh in 4-byte characters."""
    if i % 7 == 0:
        return f"{i:08d}".ljust(limits.QUEUE_NAME_BYTES_MAX // 4, "\U0001F600")[:limits.QUEUE_NAME_BYTES_MAX // 4]
    return f"{i:08d}".ljust(limits.QUEUE_NAME_BYTES_MAX, "q")


@pytest.fixture
def server(tmp_path, make_config):
    shard = DurableShard(str(tmp_path / "s"), 0, make_config(**EVERY_LIMIT))
    shard.open()
    srv = ShardServer(shard, str(tmp_path / "sock"), b"k" * 32)
    yield srv
    srv._poller.close()
    os.close(srv._wake_r)
    os.close(srv._wake_w)
    shard.close()


def add_queues(srv: ShardServer, first: int, count: int) -> list[str]:
    names = [long_name(i) for i in range(first, first + count)]
    srv.state.enqueue_many([(b"x", "g/k", n, 0, 0, None) for n in names], NOW)
    srv.state.take_batch()
    return names


def ask(srv: ShardServer, op: str, *args) -> object:
    rid, status, payload = srv._execute(None, 1, op, list(args), NOW, len(srv.state._ops))
    assert status == wire.OK, payload
    return payload


def test_pages_hold_every_queue_once_each_within_its_budget_and_page_0_the_shard_figures(server):
    names = add_queues(server, 0, 3000)
    budget = ch.SHARD_FIGURES_BYTES_MAX + 64 * 1024
    server.metrics_page_bytes = budget
    whole = ask(server, "metrics")
    one_queue = max(len(wire.pack({n: whole["queues"][n]})) + len(wire.pack({n: whole["queue_metrics"][n]}))
                    for n in names)
    seen: list[str] = []
    pages = []
    start = 0
    while start is not None:
        page = ask(server, "metrics_page", start)
        size = len(wire.pack(page))
        assert size <= budget + one_queue, (start, size)
        assert size <= budget, (start, size)  # the estimate is a bound: not even one queue more
        assert list(page["queues"]) == list(page["queue_metrics"])
        assert page["pid"] == os.getpid() and page["shard"] == 0
        seen += page["queues"]
        pages.append(page)
        assert page["next"] is None or page["next"] == len(seen)
        start = page["next"]
    assert seen == names  # every queue, once, in the order the shard made them
    assert len(pages) > 10
    # each page's entries are the whole reply's, and page 0 carries every shard-wide figure
    for page in pages:
        assert page["queues"] == {n: whole["queues"][n] for n in page["queues"]}
        assert page["queue_metrics"] == {n: whole["queue_metrics"][n] for n in page["queue_metrics"]}
    shard_wide = {k: v for k, v in whole.items() if k not in ("queues", "queue_metrics")}
    assert {k: v for k, v in pages[0].items() if k not in ("queues", "queue_metrics", "next")} == shard_wide
    assert {"jobs", "wal_bytes", "results", "workflows", "workflow_counters"} <= set(pages[0])
    for page in pages[1:]:
        assert set(page) == {"shard", "pid", "queues", "queue_metrics", "next"}


def test_a_queue_made_between_pages_comes_in_a_later_page_and_none_twice(server):
    names = add_queues(server, 0, 400)
    server.metrics_page_bytes = ch.SHARD_FIGURES_BYTES_MAX + 32 * 1024
    first = ask(server, "metrics_page", 0)
    names += add_queues(server, 400, 5)
    seen = list(first["queues"])
    start = first["next"]
    while start is not None:
        page = ask(server, "metrics_page", start)
        seen += page["queues"]
        start = page["next"]
    assert seen == names


def test_one_queue_over_the_budget_still_makes_a_page_and_a_start_past_the_end_an_empty_last_one(server):
    names = add_queues(server, 0, 3)
    server.metrics_page_bytes = 1
    got = [ask(server, "metrics_page", i) for i in range(3)]
    assert [list(p["queues"]) for p in got] == [[n] for n in names]
    assert [p["next"] for p in got] == [1, 2, None]
    assert ask(server, "metrics_page", 10) | {"pid": 0} == {"shard": 0, "pid": 0, "queues": {}, "queue_metrics": {},
                                                          "next": None}


@pytest.mark.parametrize("start", [-1, True, "0", 1.5, None, 2**63])
def test_a_start_that_is_no_position_is_refused(server, start):
    rid, status, payload = server._execute(None, 1, "metrics_page", [start], NOW, 0)
    assert status == wire.ERR and payload[0] == "InvalidJob", payload


def test_the_widest_queue_entries_fit_the_bound_the_pages_are_cut_by(make_config):
    """QUEUE_FIGURES_BYTES_MAX bounds one queue's two entries but its name and its
    override's rate strings: here a queue with every limit overridden, fenced, paused,
    undeclared, a group separator of 16 4-byte characters, and every number at its widest."""
    from shardq.shard.state import ShardState
    sep = "\U0001F600" * limits.GROUP_SEPARATOR_CHARS_MAX
    state = ShardState(0, make_config(**dict(EVERY_LIMIT, group_separator=sep)))
    name = long_name(1)
    state.enqueue_many([(b"x", "g" + sep + "k", name, 0, 0, None)], NOW)
    state.set_limits(name, {"concurrency": limits.CONCURRENCY_MAX, "rate": "999999.5/s", "burst": 999999.5,
                            "group_concurrency": limits.CONCURRENCY_MAX, "group_rate": "999999.5/s"}, NOW)
    state.queues[name].lim.fence_until = NOW + 1e9 + 0.5
    state.pause(name, NOW)
    state.undeclared.add(name)

    def widest(value):  # every number as wide as msgpack writes one, every None a float
        if isinstance(value, dict):
            return {k: widest(v) for k, v in value.items()}
        if isinstance(value, bool) or isinstance(value, str):
            return value
        if isinstance(value, int):
            return 2**63 - 1
        return 0.5

    stats, figures = state.stats()[name], state.queue_metrics(NOW)[name]
    assert stats["limits"]["runtime_override"] and stats["limits"]["fenced_until"] and stats["paused"]
    size = len(wire.pack(widest(stats))) + len(wire.pack(widest(figures)))
    rates = sum(len(v.encode()) for v in stats["limits"]["runtime_override"].values() if isinstance(v, str))
    assert size - rates <= ch.QUEUE_FIGURES_BYTES_MAX, size
    assert size - rates > ch.QUEUE_FIGURES_BYTES_MAX * 0.7, size  # a bound, not a guess far above it
    whole = len(wire.pack({name: stats})) + len(wire.pack({name: figures}))
    assert whole <= ch.queue_page_bytes(name) + rates


def test_the_pages_at_queues_max_are_each_within_the_budget_and_far_below_the_reply_limit(server):
    """What a scrape of a shard at the maximum costs, page by page (the figures in
    docs/operations.md and limits.py)."""
    names = [f"{i:08d}".ljust(limits.QUEUE_NAME_BYTES_MAX, "q") for i in range(limits.QUEUES_MAX)]
    for at in range(0, limits.QUEUES_MAX, limits.BATCH_JOBS_MAX):
        server.state.enqueue_many([(b"x", "g/k", n, 0, 0, None) for n in names[at:at + limits.BATCH_JOBS_MAX]], NOW)
        server.state.take_batch()
    sizes, count, start, slowest = [], 0, 0, 0.0
    while start is not None:
        t0 = time.perf_counter()
        page = ask(server, "metrics_page", start)
        data = wire.pack(page)
        slowest = max(slowest, time.perf_counter() - t0)
        sizes.append(len(data))
        count += len(page["queues"])
        start = page["next"]
    assert count == limits.QUEUES_MAX
    assert max(sizes) <= limits.METRICS_PAGE_BYTES < limits.REPLY_BYTES_MAX // 4
    assert len(sizes) == 16 and max(sizes) < 4_600_000  # as docs/operations.md and limits.py say
    print(f"\n{len(sizes)} pages, {sum(sizes)} bytes, largest {max(sizes)}, slowest {slowest:.3f} s")


# ---------------------------------------------------------------------- the client


@pytest.fixture(params=["threaded", "asyncio"])
def connect(request):
    import asyncio
    import threading

    import shardq
    made = []

    class SyncAsync:  # the asyncio client, called synchronously
        def __init__(self, data_dir: str, **kw):
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.q = asyncio.run_coroutine_threadsafe(shardq.aio.connect(data_dir, **kw), self.loop).result(60)

        def shard_metrics(self, timeout_s: float = 2.0):
            return asyncio.run_coroutine_threadsafe(self.q.shard_metrics(timeout_s), self.loop).result(60)

        def close(self) -> None:
            asyncio.run_coroutine_threadsafe(self.q.close(), self.loop).result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def make(data_dir: str):
        q = (shardq.connect(data_dir, retry_s=2, request_timeout_s=10) if request.param == "threaded"
             else SyncAsync(data_dir, retry_s=2, request_timeout_s=10))
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def paged(queues: dict[int, list[str]], pids: dict[int, list[int]] | None = None, per_page: int = 2):
    """A shard's answer to metrics_page: its ``queues`` ``per_page`` at a time (pids: the
    pid of each page in turn, else 100 + shard)."""
    def answer(shard, op, args):
        if op != "metrics_page":
            return Refuse("ProtocolError")
        (start,) = args
        mine = queues[shard]
        names = mine[start:start + per_page]
        after = start + per_page if start + per_page < len(mine) else None
        pid = pids[shard][start // per_page] if pids else 100 + shard
        page = {"shard": shard, "pid": pid, "queues": {n: {"ready": 1} for n in names},
                "queue_metrics": {n: {"enqueued": 1} for n in names}, "next": after}
        if start == 0:
            page["jobs"] = len(mine)
        return page
    return answer


def test_the_client_asks_every_shard_for_its_pages_and_merges_them(fake, connect):
    queues = {0: [f"a{i}" for i in range(5)], 1: ["b0"], 2: [f"c{i}" for i in range(4)]}
    f = fake(3, paged(queues))
    got = connect(f.dd.path).shard_metrics()
    for s, names in queues.items():
        assert got[s] == {"shard": s, "pid": 100 + s, "jobs": len(names), "available": True,
                          "queues": {n: {"ready": 1} for n in names},
                          "queue_metrics": {n: {"enqueued": 1} for n in names}}
    # page 0 of every shard first, then the next page of each shard that has one
    assert [args for _, _, args in f.sent("metrics_page")][:3] == [[0], [0], [0]]
    assert sorted((s, args[0]) for s, _, args in f.sent("metrics_page")) == [
        (0, 0), (0, 2), (0, 4), (1, 0), (2, 0), (2, 2)]


def test_a_shard_whose_pid_changes_between_pages_is_down_for_that_scrape(fake, connect):
    queues = {0: [f"a{i}" for i in range(5)], 1: ["b0", "b1"]}
    f = fake(2, paged(queues, pids={0: [7, 7, 8], 1: [9]}))
    got = connect(f.dd.path).shard_metrics()
    assert got[0]["available"] is False and got[0]["queues"] == {} and "restarted" in got[0]["error"]
    assert got[1]["available"] is True and list(got[1]["queues"]) == ["b0", "b1"]


def test_a_shard_before_metrics_page_is_asked_metrics_whole(fake, connect):
    """An older shard answers the op it does not know with ProtocolError (docs/upgrades.md)."""
    def answer(shard, op, args):
        if op == "metrics_page":
            return Refuse("ProtocolError")
        return {"shard": shard, "pid": 5, "queues": {"q": {"ready": 2}}, "queue_metrics": {"q": {"enqueued": 2}}}

    f = fake(2, answer)
    got = connect(f.dd.path).shard_metrics()
    assert got == [{"shard": s, "pid": 5, "queues": {"q": {"ready": 2}}, "queue_metrics": {"q": {"enqueued": 2}},
                    "available": True} for s in (0, 1)]
    assert sorted(f.requests) == [(0, "metrics", []), (0, "metrics_page", [0]), (1, "metrics", []),
                                  (1, "metrics_page", [0])]


def test_a_shard_that_leaves_a_later_page_unanswered_for_the_timeout_is_down(fake, connect):
    import threading
    slow = threading.Event()
    answer = paged({0: ["a0", "a1", "a2"], 1: ["b0"]})

    def late(shard, op, args):
        if shard == 0 and args != [0]:
            slow.wait(10)  # answers only after the scrape gave up on it
        return answer(shard, op, args)

    f = fake(2, late)
    q = connect(f.dd.path)
    t0 = time.monotonic()
    try:
        got = q.shard_metrics(timeout_s=0.5)
    finally:
        slow.set()
    assert time.monotonic() - t0 < 3
    assert got[0]["available"] is False and got[0]["queues"] == {} and got[0]["error"]
    assert got[1]["available"] is True and list(got[1]["queues"]) == ["b0"]


def test_the_budget_is_well_below_the_reply_limit():
    assert ch.ControlHandlers.metrics_page_bytes == limits.METRICS_PAGE_BYTES
    assert limits.METRICS_PAGE_BYTES * 4 <= limits.REPLY_BYTES_MAX
