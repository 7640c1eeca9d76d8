"""Huey on Redis (``RedisHuey``) or, when ``$BENCH_WK_HUEY_SQLITE`` names a file, on SQLite
(``SqliteHuey(fsync=True)``: WAL with ``synchronous=FULL``, each commit fsynced). Calling the
task enqueues it. Worker: ``huey_consumer bench.workers.apps.huey_app.huey -k thread -w 8``.

Huey's dequeue removes the job (Redis RPOP, SQLite DELETE) before it runs: a worker crash
loses the jobs it held. No crash happens here, so the figure does not show that."""
from __future__ import annotations

import os

from huey import RedisHuey, SqliteHuey

from ..record import record
from . import HUEY_SQLITE_ENV, REDIS_URL_ENV

if os.environ.get(HUEY_SQLITE_ENV):
    huey = SqliteHuey("bench", filename=os.environ[HUEY_SQLITE_ENV], fsync=True)
else:
    huey = RedisHuey("bench", url=os.environ[REDIS_URL_ENV])


@huey.task()
def noop(job_id: str) -> None:
    record(job_id)


def enqueue_all(ids: list[str]) -> None:
    for job_id in ids:
        noop(job_id)
