"""Logs written by earlier versions (formats 1 and 2, fixture files kept in the repo) still
replay to the same jobs, and the next start appends in the current format."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from shardq.clock import FakeClock
from shardq.config import parse
from shardq.shard.durable import Engine
from shardq.wal.format import FORMAT, MAGICS, SEGMENT
from support.wal_fixtures import (FIXTURES, CONFIG, jobs_of)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_log_of_an_earlier_format_replays_and_goes_on_in_the_current_one(tmp_path, version):
    with open(os.path.join(FIXTURES, "expected-jobs.json")) as f:
        expected = json.load(f)
    d = str(tmp_path / "shard")
    shutil.copytree(os.path.join(FIXTURES, version), d)
    before = sorted(os.listdir(d))
    e = Engine(d, parse(CONFIG), clock=FakeClock(1_000_100.0))
    assert jobs_of(e) == expected
    newest = sorted(n for n in os.listdir(d) if n.endswith(".wal"))[-1]
    assert newest not in before, "the old newest segment is sealed; appends go to a new one"
    with open(os.path.join(d, newest), "rb") as f:
        assert f.read(8) == MAGICS[(SEGMENT, FORMAT)]
    added = e.enqueue(b"after the upgrade", key="k0")
    e.close()
    e = Engine(d, parse(CONFIG), clock=FakeClock(1_000_200.0))
    assert e.state.jobs[added].body == b"after the upgrade"
    assert len(e.state.jobs) == len(expected) + 1
    e.compact()  # the checkpoint is written in the current format, and replays
    e.close()
    e = Engine(d, parse(CONFIG), clock=FakeClock(1_000_300.0))
    assert len(e.state.jobs) == len(expected) + 1
    e.close()
