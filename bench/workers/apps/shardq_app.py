"""shardq: the handler ``shardq worker bench.workers.apps.shardq_app:noop`` runs, and the
enqueue, ``Router.enqueue`` once per job (no key: the jobs need no order, as with the other
frameworks)."""
from __future__ import annotations

import os

import shardq

from ..record import record
from . import SHARDQ_DIR_ENV


def noop(ctx) -> None:
    record(ctx.body.decode())


def enqueue_all(ids: list[str]) -> None:
    with shardq.connect(os.environ[SHARDQ_DIR_ENV]) as q:
        for job_id in ids:
            q.enqueue(job_id.encode())
