"""Shared fixtures: a fake clock, configs from dicts, and a digest of a shard's state."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` run without `python -m` or an installed package
    sys.path.insert(0, ROOT)

from shardq import config as shardq_config  # noqa: E402 - after the sys.path line above
from shardq.clock import FakeClock  # noqa: E402 - after the sys.path line above


def pytest_sessionstart(session):
    """Compile the project's modules once, before any test starts a process. The suite
    starts thousands of Python processes (shards, services, CLI calls, workers); where
    ``PYTHONDONTWRITEBYTECODE`` is set (as on the VMs this suite is developed on), each one would
    compile every shardq module it imports from source again (about 0.1 s a process).
    Python still reads bytecode it finds; a source newer than its bytecode is compiled
    again, so nothing stale can run."""
    import compileall
    for package in ("shardq", "bench", "tests"):
        compileall.compile_dir(os.path.join(ROOT, package), quiet=1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake():
    """``fake(shards, answer)``: scripted shards on unix sockets (support/fake_shard.py),
    closed after the test."""
    from support.fake_shard import FakeShards
    made = []

    def make(shards: int, answer) -> FakeShards:
        f = FakeShards(shards, answer)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def make_config():
    """``make_config(max_deliveries=3, max_pending_jobs=10, ...)``: any queue_defaults,
    limits or service key by its bare name."""
    return config_from


def config_from(**kw) -> shardq_config.Config:
    sections = {"service": {}, "limits": {}, "queue_defaults": {}}
    queues = kw.pop("queues", None)
    for name, value in kw.items():
        for section, cls in (("service", shardq_config.ServiceConfig),
                             ("limits", shardq_config.LimitsConfig),
                             ("queue_defaults", shardq_config.QueueConfig)):
            if name in cls.__dataclass_fields__:
                sections[section][name] = value
                break
        else:
            raise TypeError(f"no config key {name!r}")
    if queues is not None:
        sections["queues"] = queues
    return shardq_config.parse(sections)


def state_digest(state) -> dict:
    """Everything observable about a :class:`ShardState`, as plain values.

    Call after advancing both states being compared to the same ``now``: lease expiry and
    delays coming due are derived from the clock, not logged. Dedup entries are compared
    only while unexpired (pruning is lazy).
    """
    from shardq.shard.state import JobState

    now = state._now
    jobs = {}
    for jid, j in state.jobs.items():
        leased = j.state is JobState.LEASED
        jobs[jid] = (j.q.name, j.key, bytes(j.body), j.priority, j.ready_at, j.attempts,
                     JobState(j.state).name, state.inflight[jid][0] if leased else None,
                     state.inflight[jid][1] if leased else None, state.errors.get(jid))
    queues = {}
    stats = {}
    for name, q in state.queues.items():
        entry = {
            "keys": {k: [j.id for j in dq] for k, dq in q.keys.items()},
            "dead": [j.id for j in q.dead.values()],
            "dedup": {k: v for k, v in q.dedup.items() if v[1] > now},
        }
        counts = state.stats()[name]
        if any(entry.values()) or any(counts.values()):  # an empty queue need not survive a restart
            queues[name] = entry
            stats[name] = counts
    return {
        "jobs": jobs,
        "queues": queues,
        "stats": stats,
        "next_seq": state.next_seq,
        # next_token is left out: each open begins a new lease-token epoch (tokens are never
        # reused after a crash; tests/shard/test_lease_sync.py), so it moves up by design.
        "sessions": {cid: {s: list(ids) for s, ids in e[1].items()} for cid, e in state.sessions.items()},
    }


@pytest.fixture
def digest():
    return state_digest


@pytest.fixture(scope="session")
def moto():
    """One ``moto_server`` (an SQS-compatible server) for the session (tests/support/sqs_server.py);
    each test takes a fresh queue-name prefix on it."""
    from support.sqs_server import MotoServer
    with MotoServer() as server:
        yield server
