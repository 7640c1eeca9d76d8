"""The enqueueing process of figure Wk: ``python -m bench.workers.enqueue APP COUNT TAG OUT``.

Imports ``bench.workers.apps.APP`` (its broker comes from the environment), enqueues COUNT
jobs with ids ``job_ids(TAG, COUNT)``, one framework call per job, and writes
``{"seconds": ...}`` to OUT: the time of the enqueue calls alone, not the imports.
"""
from __future__ import annotations

import importlib
import json
import sys
import time


def job_ids(tag: str, count: int) -> list[str]:
    """The ids of one runner's jobs in one run, unique to ``tag``."""
    return [f"{tag}:{i:07d}" for i in range(count)]


def main(argv: list[str]) -> int:
    app_name, count, tag, out = argv[0], int(argv[1]), argv[2], argv[3]
    app = importlib.import_module(f"bench.workers.apps.{app_name}")
    ids = job_ids(tag, count)
    start = time.monotonic()
    app.enqueue_all(ids)
    seconds = time.monotonic() - start
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "jobs": count}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
