"""Exact limits in the pure shard state (docs/limits.md): concurrency caps and token buckets,
per queue and per group, fair turns, held-back jobs kept in place and not counted, slots
given back by every way a lease ends, and the counts rebuilt by replay and checkpoints.
Time is the ``now`` each call takes (no clock, no sleeps)."""
from __future__ import annotations

import random

import msgpack
import pytest

from shardq import limits
from shardq.config import owner_shard, parse
from shardq.errors import Cancelled, InvalidConfig, InvalidJob
from shardq.shard.state import ShardState

T0 = 1_000_000.0


def make(queues: dict, shard: int = 0, shards: int = 1) -> ShardState:
    cfg = parse({"service": {"shards": shards}, "queues": queues})
    return ShardState(shard, cfg)


def logged(state: ShardState, log: list) -> None:
    """Keep the operations ``state`` produced, msgpack round-tripped like a real log."""
    ops = state.take_ops()
    if ops:
        log.append(msgpack.unpackb(msgpack.packb(ops), strict_map_key=False))


def replayed(queues: dict, log: list, shard: int = 0, shards: int = 1) -> ShardState:
    fresh = make(queues, shard, shards)
    fresh.replay(log)
    return fresh


def lease_all(state, queue, now, n=100):
    return state.dequeue(queue, now, max_jobs=n)


# ---------------------------------------------------------------------------- concurrency
def test_concurrency_caps_leases_and_a_held_back_job_is_not_a_delivery():
    s = make({"api": {"concurrency": 3}})
    ids = [s.enqueue(b"x", T0, key=f"k{i}", queue="api") for i in range(10)]
    got = lease_all(s, "api", T0)
    assert [le.job_id for le in got] == ids[:3]
    assert lease_all(s, "api", T0) == [] and not s.has_ready("api")
    assert all(s.jobs[j].attempts == 0 for j in ids[3:])   # held back: nothing counted
    assert s.stats()["api"]["limits"]["held_back"] == 7
    s.ack(got[0].job_id, got[0].token, T0 + 1)
    assert s.has_ready("api")
    (nxt,) = lease_all(s, "api", T0 + 1)
    assert nxt.job_id == ids[3]                              # its place was kept
    assert s.stats()["api"]["limits"]["max_in_flight_seen"] == 3


@pytest.mark.parametrize("end", ["ack", "nack", "bury", "expire", "cancel", "undelivered"])
def test_every_way_a_lease_ends_gives_its_slot_back(end):
    s = make({"api": {"concurrency": 1, "visibility_timeout": 5}})
    a = s.enqueue(b"a", T0, key="a", queue="api")
    b = s.enqueue(b"b", T0, key="b", queue="api")
    (le,) = lease_all(s, "api", T0)
    assert le.job_id == a and lease_all(s, "api", T0) == []
    now = T0 + 1
    if end == "ack":
        s.ack(a, le.token, now)
    elif end == "nack":
        s.nack(a, le.token, now, delay=100)
    elif end == "bury":
        s.bury(a, le.token, now)
    elif end == "undelivered":
        s.nack(a, le.token, now, delivered=False)
    elif end == "expire":
        now = T0 + 6
    else:
        s.cancel(a, now)                                      # marked: still holds its slot
        assert lease_all(s, "api", now) == []
        with pytest.raises(Cancelled):
            s.ack(a, le.token, now)                           # Cancelled: now it is gone
    got = lease_all(s, "api", now)
    assert len(got) == 1 and (got[0].job_id == b or end in ("expire", "undelivered"))


def test_replay_and_checkpoint_rebuild_what_is_in_flight():
    q = {"api": {"concurrency": 2, "group_separator": "/", "group_concurrency": 1}}
    s, log = make(q), []
    for i in range(6):
        s.enqueue(b"x", T0, key=f"g{i % 2}/{i}", queue="api")
    got = lease_all(s, "api", T0)
    logged(s, log)
    assert len(got) == 2
    for again in (replayed(q, log), ShardState(0, s.config)):
        if again.jobs == {}:
            again.replay([msgpack.unpackb(c, strict_map_key=False) for c in s.snapshot()])
        assert again.queues["api"].counts[3] == 2
        assert {g: line.inflight for g, line in again.queues["api"].lim.lines.items() if line.inflight} == \
            {"g0": 1, "g1": 1}
        assert lease_all(again, "api", T0 + 1) == []          # never past the cap after a restart
        again.ack(got[0].job_id, got[0].token, T0 + 1)
        (one,) = lease_all(again, "api", T0 + 1)
        assert one.key.startswith(got[0].key.split("/")[0])  # the freed group's next job


# ---------------------------------------------------------------------------- rate
def test_the_bucket_starts_empty_and_refills_at_the_rate():
    s = make({"api": {"rate": "10/s"}})
    for i in range(100):
        s.enqueue(b"x", T0, key=f"k{i}", queue="api")
    assert lease_all(s, "api", T0) == []                      # empty at start: no burst on restart
    assert s.next_deadline() == pytest.approx(T0 + 0.1)       # the long poll wakes for the token
    assert len(lease_all(s, "api", T0 + 0.1)) == 1
    assert len(lease_all(s, "api", T0 + 1.0)) == 9
    assert len(lease_all(s, "api", T0 + 60)) == 10            # burst: one second's worth
    assert s.stats()["api"]["limits"]["tokens"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_rate_over_any_one_second_window_is_at_most_rate_plus_burst(seed):
    rng = random.Random(seed)
    rate, burst = 20, 5
    q = {"api": {"rate": f"{rate}/s", "burst": burst, "visibility_timeout": 0.05}}
    s, log = make(q), []
    for i in range(3000):
        s.enqueue(b"x", T0, key=f"k{i}", queue="api")
    starts, now = [], T0
    for step in range(1500):
        now += rng.choice([0.0, 0.001, 0.01, 0.05, 0.3, 2.0])
        if step == 700:                                       # a restart: the log replays
            logged(s, log)
            s = replayed(q, log)
        for le in s.dequeue("api", now, max_jobs=rng.randint(1, 30)):
            starts.append(now)
            s.ack(le.job_id, le.token, now)
        logged(s, log)
    assert len(starts) > 500
    j = 0
    for i, t in enumerate(starts):                            # every window starting at a lease
        while starts[j] < t - 1.0 + 1e-12:
            j += 1
        assert i - j + 1 <= rate + burst


def test_a_group_rate_holds_back_only_its_group():
    s = make({"r": {"group_separator": "/", "group_rate": "2/s"}})
    for i in range(5):
        s.enqueue(b"a", T0, key=f"a/{i}", queue="r")
    b = s.enqueue(b"b", T0, key="b/0", queue="r")
    assert lease_all(s, "r", T0) == []                        # every bucket starts empty
    got = lease_all(s, "r", T0 + 1.0)                         # two tokens each by now
    assert [le.key for le in got] == ["a/0", "a/1", "b/0"]  # b's token is its own
    assert s.jobs[b].state == 3
    s.ack(got[0].job_id, got[0].token, T0 + 1.0)
    assert lease_all(s, "r", T0 + 1.0) == []                  # a/2 waits for a's next token
    assert s.stats()["r"]["limits"]["groups_held_back"] == 1
    assert s.next_deadline() == pytest.approx(T0 + 1.5)
    assert [le.key for le in lease_all(s, "r", T0 + 1.5)] == ["a/2"]


# ---------------------------------------------------------------------------- groups, fairness
def test_group_concurrency_skips_a_full_group_without_moving_its_jobs():
    s = make({"r": {"group_separator": "/", "group_concurrency": 1}})
    keys = ["a/1", "a/2", "b/1", "a/3", "b/2", "c/1"]
    for k in keys:
        s.enqueue(b"x", T0, key=k, queue="r")
    first = lease_all(s, "r", T0)
    assert [le.key for le in first] == ["a/1", "b/1", "c/1"]
    assert s.stats()["r"]["limits"]["held_back"] == 3
    for le in first:
        s.ack(le.job_id, le.token, T0)
    assert [le.key for le in lease_all(s, "r", T0)] == ["a/2", "b/2", "a/3"][:2]
    assert s.stats()["r"]["limits"]["max_group_in_flight_seen"] == 1


def test_keyless_jobs_and_keys_without_separator_are_groups_too():
    s = make({"r": {"group_separator": "/", "group_concurrency": 1}})
    s.enqueue(b"x", T0, queue="r")
    s.enqueue(b"x", T0, queue="r")
    s.enqueue(b"x", T0, key="plain", queue="r")
    assert len(lease_all(s, "r", T0)) == 2                    # one keyless, one "plain"


@pytest.mark.parametrize("fair", [True, False])
def test_fair_turns_serve_a_late_small_group_at_once(fair):
    s = make({"r": {"group_separator": "/", "fair": fair}})
    for i in range(1000):
        s.enqueue(b"a", T0, key=f"A/{i}", queue="r")
    for i in range(10):
        s.enqueue(b"b", T0, key=f"B/{i}", queue="r")
    seen, now = [], T0
    while len([k for k in seen if k.startswith("B")]) < 10:
        for le in s.dequeue("r", now, max_jobs=1):
            seen.append(le.key)
            s.ack(le.job_id, le.token, now)
    before_last_b = len(seen) - 1
    assert before_last_b == (19 if fair else 1009)


def test_priorities_within_a_group_then_queue_order_across_groups():
    s = make({"r": {"group_separator": "/"}})
    s.enqueue(b"x", T0, key="a/1", queue="r")
    s.enqueue(b"x", T0, key="b/1", queue="r", priority=5)
    s.enqueue(b"x", T0, key="a/2", queue="r", priority=9)
    assert [le.key for le in lease_all(s, "r", T0)] == ["a/2", "b/1", "a/1"]


def test_a_job_past_max_deliveries_is_dead_lettered_not_counted():
    s = make({"r": {"group_separator": "/", "group_concurrency": 1, "max_deliveries": 1,
                    "visibility_timeout": 1}})
    a = s.enqueue(b"x", T0, key="a/1", queue="r")
    s.enqueue(b"x", T0, key="a/2", queue="r")
    assert [le.job_id for le in lease_all(s, "r", T0)] == [a]
    got = lease_all(s, "r", T0 + 2)                           # a/1 expired and dies; a/2 leases
    assert [le.key for le in got] == ["a/2"] and s.jobs[a].state == 4


# ---------------------------------------------------------------------------- run-time changes
def test_limits_change_at_run_time_durably():
    q = {"api": {"concurrency": 1}}
    s, log = make(q), []
    for i in range(10):
        s.enqueue(b"x", T0, key=f"k{i}", queue="api")
    assert len(lease_all(s, "api", T0)) == 1
    fig = s.set_limits("api", {"concurrency": 4}, T0)
    assert fig["concurrency"] == 4
    assert len(lease_all(s, "api", T0)) == 3
    s.set_limits("api", {"rate": "50/s"}, T0)                # adds to the earlier change
    logged(s, log)
    again = replayed(q, log)
    assert again.queues["api"].lim.s.concurrency == 4 and again.queues["api"].lim.s.rate == 50
    ckpt = ShardState(0, s.config)
    ckpt.replay([msgpack.unpackb(c, strict_map_key=False) for c in s.snapshot()])
    assert ckpt.queues["api"].lim.override == {"concurrency": 4, "rate": "50/s"}
    s.set_limits("api", None, T0)                             # back to the config
    assert s.queues["api"].lim.s.concurrency == 1 and s.queue_settings("api")["concurrency"] == 1


def test_run_time_changes_are_checked_and_only_for_placed_queues():
    s = make({"api": {"concurrency": 1}, "plain": {}})
    for bad, key in (({"rate": "fast"}, "rate"), ({"concurrency": 0}, "concurrency"),
                     ({"burst": -1}, "burst"), ({"group_concurrency": 2}, "group_concurrency")):
        with pytest.raises(InvalidConfig, match=key):
            s.set_limits("api", bad, T0)
    with pytest.raises(InvalidConfig, match="fair|limits"):
        s.set_limits("api", {"fair": True}, T0)
    with pytest.raises(InvalidConfig, match="declares no limit"):
        s.set_limits("plain", {"concurrency": 3}, T0)
    assert s.take_ops() == []


def test_a_run_time_burst_without_a_rate_is_refused_as_the_config_refuses_it():
    """Issue 44, item 12: a run-time ``burst`` on a queue with no ``rate`` was accepted,
    shown as an override and ignored. The config's own check (``config.check_limits``) now
    runs on the limits in force after the change, so the refusal is the config's, word for
    word, and nothing is logged."""
    with pytest.raises(InvalidConfig) as by_config:
        parse({"queues": {"api": {"concurrency": 1, "burst": 5}}})
    s = make({"api": {"concurrency": 1}, "paced": {"rate": "20/s", "burst": 5}})
    with pytest.raises(InvalidConfig) as at_run_time:
        s.set_limits("api", {"burst": 5}, T0)
    assert str(at_run_time.value) == str(by_config.value) == "queues.api.burst: needs queues.api.rate " \
                                                             "(burst is the tokens of the rate's bucket)"
    with pytest.raises(InvalidConfig, match=r"queues\.paced\.burst: needs queues\.paced\.rate"):
        s.set_limits("paced", {"rate": None}, T0)           # the config's burst would be left without its rate
    with pytest.raises(InvalidConfig, match=r"queues\.api\.group_concurrency: needs queues\.api\.group_separator"):
        s.set_limits("api", {"group_concurrency": 2}, T0)
    assert s.take_ops() == []
    s.set_limits("api", {"rate": "10/s"}, T0)                 # a rate first (an earlier change) ...
    assert s.set_limits("api", {"burst": 3}, T0)["burst"] == 3    # ... then its burst is fine
    with pytest.raises(InvalidConfig, match=r"queues\.api\.burst: needs queues\.api\.rate"):
        s.set_limits("api", {"rate": None}, T0)             # checked against the merged override
    assert s.queues["api"].lim.override == {"rate": "10/s", "burst": 3.0}
    s.set_limits("paced", {"rate": None, "burst": None}, T0)  # both removed together: no bucket at all
    assert s.queues["paced"].lim.s.rate is None


def test_run_time_limits_at_their_maximum_and_one_past_it():
    s = make({"api": {"concurrency": 1, "group_separator": "/"}})
    top = {"concurrency": limits.CONCURRENCY_MAX, "rate": f"{int(limits.RATE_PER_S_MAX)}/s",
           "burst": limits.BURST_MAX, "group_concurrency": limits.CONCURRENCY_MAX,
           "group_rate": f"{int(limits.RATE_PER_S_MAX)}/s"}
    s.set_limits("api", top, T0)
    in_force = s.queues["api"].lim.s
    assert (in_force.concurrency, in_force.rate, in_force.burst, in_force.group_concurrency,
            in_force.group_rate) == (limits.CONCURRENCY_MAX, limits.RATE_PER_S_MAX, limits.BURST_MAX,
                                     limits.CONCURRENCY_MAX, limits.RATE_PER_S_MAX)
    past = {"concurrency": limits.CONCURRENCY_MAX + 1, "rate": f"{int(limits.RATE_PER_S_MAX) + 1}/s",
            "burst": limits.BURST_MAX + 1, "group_concurrency": limits.CONCURRENCY_MAX + 1,
            "group_rate": f"{int(limits.RATE_PER_S_MAX) + 1}/s"}
    s.take_ops()
    for key, value in past.items():
        with pytest.raises(InvalidConfig, match=rf"queues\.api\.{key}"):
            s.set_limits("api", {key: value}, T0)
        with pytest.raises(InvalidConfig, match=rf"queues\.api\.{key}"):  # the config, the same way
            parse({"queues": {"api": {"rate": "1/s", "group_separator": "/", key: value}}})
    assert s.take_ops() == [] and s.queues["api"].lim.s.concurrency == limits.CONCURRENCY_MAX


@pytest.mark.parametrize("rate, shown", [("3000000/s", "3000000/s"), ("0.00001/s", "0.00001/s"),
                                         ("1000001/s", "1000001/s")])
def test_a_rate_out_of_range_is_told_as_it_is_written_never_with_an_exponent(rate, shown):
    """The error said "'3000000/s' is 3e+06/s, outside [one a day, 1e+06/s]" (Python's %g)."""
    with pytest.raises(InvalidConfig) as e:
        parse({"queues": {"api": {"rate": rate}}})
    assert f"is {shown}, outside [one a day, 1000000/s]" in str(e.value) and "e+" not in str(e.value)
    assert "e-" not in str(e.value).replace("one a day", "")


# ---------------------------------------------------------------------------- placement
def test_a_placed_queue_takes_jobs_on_its_owner_shard_only():
    shards = 4
    owner = owner_shard("api", shards)
    other = (owner + 1) % shards
    q = {"api": {"concurrency": 5}}
    assert make(q, owner, shards).queue_settings("api")["shard"] == owner
    assert make({"plain": {}}, other, shards).queue_settings("plain")["shard"] is None
    make(q, owner, shards).enqueue(b"x", T0, key="k", queue="api")
    with pytest.raises(InvalidJob, match=f"shard {owner}"):
        make(q, other, shards).enqueue(b"x", T0, key="k", queue="api")


def test_a_queue_placed_after_it_held_jobs_drains_them_under_the_same_limits():
    log: list = []
    s = make({"api": {}}, 1, 2)
    for i in range(5):
        s.enqueue(b"x", T0, key=f"k{i}", queue="api")
    logged(s, log)
    later = replayed({"api": {"concurrency": 2}}, log, 1, 2)  # restarted with a limit
    assert len(lease_all(later, "api", T0)) == 2                # on whichever shard holds them


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad,key", [
    ({"rate": "fast"}, "rate"), ({"rate": 25}, "rate"), ({"rate": "0/s"}, "rate"), ({"rate": "5/d"}, "rate"),
    ({"concurrency": 0}, "concurrency"), ({"concurrency": 2.5}, "concurrency"),
    ({"concurrency": limits.CONCURRENCY_MAX + 1}, "concurrency"),
    ({"group_separator": 3, "group_concurrency": 1}, "group_separator"),
    ({"group_separator": ""}, "group_separator"), ({"fair": "yes", "group_separator": "/"}, "fair"),
    ({"group_concurrency": 2}, "group_concurrency"), ({"burst": 5}, "burst"),
    ({"rate": "1/s", "burst": 0.5}, "burst"),
])
def test_bad_limits_are_refused_naming_the_key(bad, key):
    with pytest.raises(InvalidConfig, match=rf"queues\.q\.{key}"):
        parse({"queues": {"q": bad}})


def test_rates_in_every_unit_and_at_their_bounds():
    cfg = parse({"queues": {"a": {"rate": "25/s"}, "b": {"rate": "120/m"}, "c": {"rate": "7200/h"},
                            "top": {"rate": f"{int(limits.RATE_PER_S_MAX)}/s", "burst": limits.BURST_MAX,
                                    "concurrency": limits.CONCURRENCY_MAX},
                            "slow": {"rate": "1/h"}}})
    s = ShardState(0, cfg)
    assert [s.queues.get(n) or s._queue(n, create=False) for n in "abc"]
    assert [ShardState(0, cfg)._queue(n, create=False).lim.s.rate for n in ("a", "b", "c")] == [25, 2, 2]
    top = s._queue("top", create=False).lim.s
    assert (top.rate, top.burst, top.concurrency) == (limits.RATE_PER_S_MAX, limits.BURST_MAX,
                                                      limits.CONCURRENCY_MAX)
    assert s._queue("slow", create=False).lim.s.burst == 1    # at least one token
    assert parse(cfg.to_dict()) == cfg                        # the shards get the config as a dict


# ---------------------------------------------------------------------------- the boot fence
def test_a_fence_holds_every_placed_queue_until_it_ends_and_wakes_the_shard_then():
    """After a power cut may have taken early leases from the log (boot_fence.py), no placed
    queue leases anything until they have all run out; other queues are not held."""
    s = make({"api": {"concurrency": 3}, "grouped": {"group_separator": "/", "group_concurrency": 1},
              "plain": {}})
    s.fence_placed(T0 + 30)
    for q in ("api", "grouped", "plain"):
        s.enqueue(b"x", T0, key="g/1", queue=q)
    s.advance(T0)
    assert lease_all(s, "api", T0) == [] and lease_all(s, "grouped", T0 + 29.9) == []
    assert not s.has_ready("api") and not s.has_ready("grouped")
    assert len(lease_all(s, "plain", T0)) == 1
    lim = s.stats()["api"]["limits"]
    assert lim["fenced_until"] == T0 + 30 and lim["held_back"] == 1 and lim["in_flight"] == 0
    assert s.next_deadline() == T0 + 30                         # a waiting dequeue is woken then
    s.enqueue(b"x", T0, queue="late")                           # undeclared: not placed, not held
    assert len(lease_all(s, "late", T0)) == 1
    s.advance(T0 + 30)
    assert "fenced_until" not in s.stats()["api"]["limits"]
    assert len(lease_all(s, "api", T0 + 30)) == 1 and len(lease_all(s, "grouped", T0 + 30)) == 1


def test_a_placed_queue_made_after_the_fence_is_fenced_too():
    s = make({"api": {"concurrency": 3}})
    s.fence_placed(T0 + 5)
    s.enqueue(b"x", T0, queue="api")                           # the queue is made here
    assert lease_all(s, "api", T0 + 4) == [] and len(lease_all(s, "api", T0 + 5)) == 1


@pytest.mark.parametrize("change", [{"concurrency": 1}, {"concurrency": None}], ids=["to-1", "to-none"])
def test_a_run_time_change_dropped_with_the_queues_limits_stays_dropped_when_they_come_back(tmp_path, change):
    """docs/limits.md: removing every limit from a queue's config (and restarting) drops a
    run-time change logged for it. The change's record stayed in the log (no compaction in
    between), so a later config with the limit again replayed it: concurrency 1 where the
    config said 3, or (changed to none) no cap at all, 10 leases at once (a walkthrough)."""
    from shardq.shard.durable import DurableShard
    limited = parse({"service": {"shards": 1}, "queues": {"eq": {"concurrency": 3}}})
    plain = parse({"service": {"shards": 1}, "queues": {"eq": {}}})
    for cfg, values in ((limited, change), (plain, None), (limited, None)):
        shard = DurableShard(str(tmp_path), 0, cfg)
        shard.open(now=T0)
        if values is not None:
            shard.state.set_limits("eq", values, T0)
            shard.commit()
        shard.close()
    again = DurableShard(str(tmp_path), 0, limited)
    again.open(now=T0)
    settings = again.state.queue_settings("eq")
    assert settings["concurrency"] == 3 and "runtime_override" not in settings, settings
    assert again.state.queues["eq"].lim.override is None


def test_the_most_leases_seen_in_flight_counts_those_a_restart_restored():
    """After a restart ``max_in_flight_seen`` said 0 with 3 leases in flight (replay
    restores them without a lease call to count them; a walkthrough)."""
    q = {"api": {"concurrency": 3}}
    s, log = make(q), []
    for i in range(5):
        s.enqueue(b"x", T0, key=f"k{i}", queue="api")
    assert len(lease_all(s, "api", T0)) == 3
    logged(s, log)
    again = replayed(q, log)
    again.advance(T0 + 1.0)  # (the leases run 30 s)
    figures = again.stats()["api"]["limits"]
    assert (figures["in_flight"], figures["max_in_flight_seen"]) == (3, 3)


def test_held_back_counts_a_group_its_last_lease_brought_to_its_cap_at_once():
    """``held_back`` and ``groups_held_back`` said 0 right after the leases that brought a
    group to its cap, with its other jobs ready, until the next dequeue looked at the
    group again (a walkthrough); and a group out of tokens likewise."""
    s = make({"r": {"group_separator": "/", "group_concurrency": 2}, "t": {"group_separator": "/",
                                                                          "group_rate": "1/s"}})
    for i in range(6):
        s.enqueue(b"x", T0, key=f"a/{i}", queue="r")
        s.enqueue(b"x", T0, key=f"b/{i}", queue="t")
    assert len(s.dequeue("r", T0, max_jobs=2)) == 2
    assert s.dequeue("t", T0, max_jobs=1) == []  # its buckets start empty, when it is first used
    assert len(s.dequeue("t", T0 + 1.0, max_jobs=1)) == 1  # group b's one token by then
    stats = s.stats()
    assert (stats["r"]["limits"]["groups_held_back"], stats["r"]["limits"]["held_back"]) == (1, 4)
    assert (stats["t"]["limits"]["groups_held_back"], stats["t"]["limits"]["held_back"]) == (1, 5)


@pytest.mark.parametrize("key, value", [("group_separator", ":"), ("fair", True)])
def test_a_run_time_change_of_a_grouping_key_names_it_and_says_it_is_the_configs(key, value):
    """``group_separator`` and ``fair`` are read when serve starts; a run-time change of one
    got the generic 'expected a map of some of ...' with the key only inside the input
    repeated (a walkthrough)."""
    s = make({"r": {"group_separator": "/", "group_concurrency": 1}})
    with pytest.raises(InvalidConfig, match=rf"^queues\.r\.{key}: set in the config only, read when serve starts"):
        s.set_limits("r", {key: value}, T0)


@pytest.mark.parametrize("fair", [True, False])
def test_the_keyless_group_and_a_named_one_held_back_until_the_same_moment_both_come_back(fair):
    """Found by a console walkthrough: keyless jobs (group None) and keyed ones of a queue
    with a group_rate, held back with their next tokens due at the same moment, were
    compared by group (None < 'tenant'): TypeError, and the shard process exited."""
    s = make({"r": {"group_separator": "/", "group_rate": "1/s", "fair": fair}})
    for _ in range(2):
        s.enqueue(b"x", T0, key=None, queue="r")
        s.enqueue(b"x", T0, key="tenant/a", queue="r")
        s.enqueue(b"x", T0, key="tenant/b", queue="r")
    assert lease_all(s, "r", T0) == []  # the buckets start empty
    got = lease_all(s, "r", T0 + 1)  # one token each: the keyless group's and the tenant's
    assert sorted(str(s.jobs[le.job_id].key) for le in got) in (["None", "tenant/a"], ["None", "tenant/b"])
    assert lease_all(s, "r", T0 + 1) == []  # both held back, their tokens due at T0 + 2
    again = lease_all(s, "r", T0 + 2)
    assert len(again) == 2 and {s.jobs[le.job_id].key is None for le in again} == {True, False}
