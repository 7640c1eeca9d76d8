"""The data dirs each log format wrote (tests/fixtures/wal-formats) and how to read their jobs."""
from __future__ import annotations

import os




FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "wal-formats")


CONFIG = {"limits": {"segment_bytes": 4096}, "queues": {"other": {}}}


def jobs_of(engine) -> list:
    return sorted([j.id, j.q.name, j.key, j.body.hex(), j.attempts, j.state] for j in engine.state.jobs.values())
