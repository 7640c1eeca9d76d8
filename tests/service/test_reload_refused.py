"""A reload (SIGHUP) that changes ``service.shards`` or ``service.data_dir``: the plan said
"needs a restart" for them like any ``[service]`` key, and the restart then failed
(ShardCountMismatch, exit 5: the shard count is fixed for a data dir) or served another data
dir. They are refused: :attr:`Plan.refused`, why :data:`WHY_REFUSED`, and the config in force
keeps the old value. The pure plan (shardq/service/reload.py), no service."""
from __future__ import annotations

from shardq.config import parse
from shardq.service import reload
from shardq.service.reload import WHY_TABLE, plan


def test_a_new_shard_count_is_refused_not_left_for_a_restart():
    old, new = parse({"service": {"shards": 2}}), parse({"service": {"shards": 3}})
    # what the supervisor logs today (it reads .restart): the why says a restart will not take it
    (change,) = plan(old, new).restart
    assert "serve will not start" in change.why and "takes effect" not in change.why, change
    WHY_REFUSED = reload.WHY_REFUSED
    for p in (plan(old, new), plan(old, new, shards=2)):
        assert [(c.key, c.old, c.new, c.why) for c in p.refused] == [
            ("service.shards", 2, 3, WHY_REFUSED["service.shards"])]
        assert p.pending == [] and p.applied == []
        assert "serve will not start" in p.refused[0].why and "ShardCountMismatch" in p.refused[0].why
        assert p.config.service.shards == 2
    assert p.restart == p.refused  # a caller that reads only .restart still sees it, with this why


def test_a_new_data_dir_is_refused():
    WHY_REFUSED = reload.WHY_REFUSED
    old = parse({"service": {"data_dir": "/var/lib/shardq"}})
    new = parse({"service": {"data_dir": "/srv/shardq", "health_timeout": 7}})
    p = plan(old, new)
    assert [(c.key, c.why) for c in p.refused] == [("service.data_dir", WHY_REFUSED["service.data_dir"])]
    assert [(c.key, c.why) for c in p.pending] == [("service.health_timeout", WHY_TABLE["service"])]
    assert p.config.service.data_dir == "/var/lib/shardq"
    # the same directory written another way is no change a restart refuses
    same = plan(old, parse({"service": {"data_dir": "/var/lib/shardq/"}}))
    assert same.refused == [] and [c.key for c in same.pending] == ["service.data_dir"]


def test_a_shard_count_a_restart_can_take_waits_for_it():
    # 0 is the data dir's count whatever it is; the data dir's own count, when known, too
    to_zero = plan(parse({"service": {"shards": 2}}), parse({"service": {"shards": 0}}))
    assert to_zero.refused == [] and [(c.key, c.why) for c in to_zero.pending] == [
        ("service.shards", WHY_TABLE["service"])]
    to_its_count = plan(parse({}), parse({"service": {"shards": 4}}), shards=4)
    assert to_its_count.refused == [] and [c.key for c in to_its_count.pending] == ["service.shards"]
    unknown = plan(parse({}), parse({"service": {"shards": 4}}))  # count not known: refused
    assert [c.key for c in unknown.refused] == ["service.shards"]
    assert plan(parse({}), parse({}), shards=4) == ([], [], parse({}))
