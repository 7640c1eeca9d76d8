"""The console's actions refuse a queue that does not exist (issue 44, item 8), as ``shardq
queue`` does, with the same check (client/queue_names.py): pause, resume and limits of a
name the service neither holds nor declares is UnknownQueue (a 400), and no phantom queue
is left in stats. A declared queue that holds nothing yet is a queue. In-process API over a
real service's router."""
from __future__ import annotations

import pytest

from shardq.errors import UnknownQueue
from shardq.service.console.api import ConsoleApi

from support.service import Service

CONFIG = {"queues": {"default": {}, "capped": {"concurrency": 2}}}


@pytest.fixture(scope="module")
def api():
    with Service(config=CONFIG) as s, s.connect() as q:
        yield ConsoleApi(q), q


@pytest.mark.parametrize("action,data", [("pause", {"queue": "typo"}), ("resume", {"queue": "typo"}),
                                         ("limits", {"queue": "typo", "values": {"concurrency": 3}})])
def test_an_unknown_queue_is_refused_and_not_made(api, action, data):
    console, q = api
    with pytest.raises(UnknownQueue, match=r"no queue 'typo'.*queues that exist"):
        getattr(console, action)(data)
    assert "typo" not in q.stats()["queues"]


def test_a_declared_queue_with_no_job_yet_can_be_paused(api):
    console, q = api
    assert console.pause({"queue": "capped"})["changed_shards"] == 2
    assert q.stats()["queues"]["capped"]["paused"] is True
    assert console.resume({"queue": "capped"})["changed_shards"] == 2
