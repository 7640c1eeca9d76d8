"""Configuration: the default file loads; every mistake is InvalidConfig naming the key."""
from __future__ import annotations

import math
import os

import pytest

from shardq import limits
from shardq.config import Config, QueueConfig, default_shards, load, parse
from shardq.errors import InvalidConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOML = os.path.join(ROOT, "config", "shardq.toml")


def test_the_default_file_loads_and_means_the_defaults():
    cfg = load(DEFAULT_TOML)
    assert cfg == Config()
    assert cfg.queues == {"default": QueueConfig()}
    assert cfg.queue_defaults.visibility_timeout == limits.VISIBILITY_TIMEOUT_S_DEFAULT
    assert cfg.limits.max_pending_jobs == limits.PENDING_JOBS_MAX_DEFAULT
    assert cfg.resolved_shards() == max(1, len(os.sched_getaffinity(0)) // 2)


def test_the_default_shard_count_is_one_per_two_cpus():
    assert [default_shards(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    # never more than a data dir takes, however many CPUs (Linux allows 8192)
    top = 2 * limits.SHARDS_MAX
    assert [default_shards(n) for n in (top, top + 2, 8192)] == [limits.SHARDS_MAX] * 3
    assert load({"service": {"shards": 3}}).resolved_shards() == 3  # an explicit count wins


def test_none_dict_and_config_sources():
    assert load(None) == Config()
    assert load({}) == Config()
    cfg = load({"service": {"shards": 4}})
    assert load(cfg) is cfg and cfg.resolved_shards() == 4


def test_a_toml_file_with_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("""
[service]
shards = 3
declare_queues = true
[limits]
segment_bytes = 8192
[queue_defaults]
visibility_timeout = 12.5
max_deliveries = 7
[queues.emails]
max_deliveries = 2
[queues.default]
""")
    cfg = load(str(path))
    assert cfg.service.shards == 3 and cfg.service.declare_queues
    assert cfg.limits.segment_bytes == 8192
    emails = cfg.queue("emails")
    # a queue section overrides queue_defaults key by key
    assert (emails.max_deliveries, emails.visibility_timeout) == (2, 12.5)
    assert cfg.queue("default").max_deliveries == 7
    assert cfg.queue("undeclared") is None  # declare_queues = true
    assert load({"queue_defaults": {"dedup_window": 9}}).queue("anything").dedup_window == 9.0


def test_to_dict_round_trips():
    cfg = parse({"service": {"shards": 2}, "queues": {"a": {"max_deliveries": 9}, "default": {}}})
    assert parse(cfg.to_dict()) == cfg


@pytest.mark.parametrize("raw,key", [
    ({"servce": {}}, "servce"),
    ({"service": {"shard": 2}}, "service.shard"),
    ({"limits": {"max_pending": 10}}, "limits.max_pending"),
    ({"queue_defaults": {"visibility": 10}}, "queue_defaults.visibility"),
    ({"queues": {"mail": {"retries": 3}}}, "queues.mail.retries"),
    ({"service": {"max_deliveries": 3}}, "service.max_deliveries"),  # right key, wrong section
])
def test_unknown_keys(raw, key):
    with pytest.raises(InvalidConfig) as info:
        parse(raw)
    assert key in str(info.value) and "unknown" in str(info.value)


@pytest.mark.parametrize("raw,key", [
    ({"service": {"shards": "4"}}, "service.shards"),
    ({"service": {"shards": True}}, "service.shards"),
    ({"service": {"shards": 1.5}}, "service.shards"),
    ({"service": {"declare_queues": 1}}, "service.declare_queues"),
    ({"service": {"declare_queues": "yes"}}, "service.declare_queues"),
    ({"service": {"data_dir": 5}}, "service.data_dir"),
    ({"service": {"data_dir": ""}}, "service.data_dir"),
    ({"service": {"health_timeout": "10"}}, "service.health_timeout"),
    ({"service": {"busy_poll_us": 1.5}}, "service.busy_poll_us"),
    ({"service": {"busy_poll_us": True}}, "service.busy_poll_us"),
    ({"limits": {"segment_bytes": 4096.0}}, "limits.segment_bytes"),
    ({"queue_defaults": {"visibility_timeout": "30"}}, "queue_defaults.visibility_timeout"),
    ({"queue_defaults": {"max_deliveries": False}}, "queue_defaults.max_deliveries"),
    ({"queues": {"q": {"max_body_bytes": [1]}}}, "queues.q.max_body_bytes"),
    ({"service": 3}, "service"),
    ({"queues": []}, "queues"),
    ({"queues": {"q": 3}}, "queues.q"),
])
def test_wrong_types(raw, key):
    with pytest.raises(InvalidConfig) as info:
        parse(raw)
    assert str(info.value).startswith(key + ":")


@pytest.mark.parametrize("raw,key", [
    ({"service": {"shards": -1}}, "service.shards"),
    ({"service": {"shards": limits.SHARDS_MAX + 1}}, "service.shards"),
    ({"service": {"restart_limit": 0}}, "service.restart_limit"),
    ({"service": {"health_timeout": 0}}, "service.health_timeout"),
    ({"service": {"busy_poll_us": -1}}, "service.busy_poll_us"),
    ({"service": {"busy_poll_us": 10_001}}, "service.busy_poll_us"),
    ({"limits": {"max_pending_jobs": 0}}, "limits.max_pending_jobs"),
    ({"limits": {"segment_bytes": 100}}, "limits.segment_bytes"),
    ({"limits": {"compact_min_bytes": 1}}, "limits.compact_min_bytes"),
    ({"queue_defaults": {"visibility_timeout": 0}}, "queue_defaults.visibility_timeout"),
    ({"queue_defaults": {"visibility_timeout": limits.VISIBILITY_TIMEOUT_S_MAX + 1}},
     "queue_defaults.visibility_timeout"),
    ({"queue_defaults": {"visibility_timeout": math.nan}}, "queue_defaults.visibility_timeout"),
    ({"queue_defaults": {"dedup_window": math.inf}}, "queue_defaults.dedup_window"),
    ({"queue_defaults": {"dedup_window": -1}}, "queue_defaults.dedup_window"),
    ({"queue_defaults": {"max_deliveries": 0}}, "queue_defaults.max_deliveries"),
    ({"queues": {"q": {"max_body_bytes": limits.BODY_BYTES_MAX_CEILING + 1}}}, "queues.q.max_body_bytes"),
])
def test_out_of_range_values(raw, key):
    with pytest.raises(InvalidConfig) as info:
        parse(raw)
    assert str(info.value).startswith(key + ":")


@pytest.mark.parametrize("name", ["", "q" * (limits.QUEUE_NAME_BYTES_MAX + 1)])
def test_bad_queue_names(name):
    with pytest.raises(InvalidConfig) as info:
        parse({"queues": {name: {}}})
    assert "queue name" in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[service\nshards = 2\n")
    with pytest.raises(InvalidConfig) as info:
        load(str(bad))
    assert str(bad) in str(info.value)
    missing = tmp_path / "missing.toml"
    with pytest.raises(InvalidConfig) as info:
        load(str(missing))
    assert str(missing) in str(info.value)
    typo = tmp_path / "typo.toml"
    typo.write_text("[limits]\nsegment_byte = 4096\n")
    with pytest.raises(InvalidConfig) as info:
        load(str(typo))
    assert "limits.segment_byte" in str(info.value)


def test_a_top_level_that_is_not_a_table():
    with pytest.raises(InvalidConfig):
        parse([("service", {})])


def test_busy_poll_us_takes_its_whole_range():
    assert parse({}).service.busy_poll_us == 300
    assert parse({"service": {"busy_poll_us": 0}}).service.busy_poll_us == 0
    assert parse({"service": {"busy_poll_us": 10_000}}).service.busy_poll_us == 10_000
