"""RQ: ``Queue.enqueue`` of a module-level function, default settings. Workers:
``rq worker bench`` (forks a work horse per job) and ``rq worker -w rq.SimpleWorker bench``
(runs jobs in the worker process)."""
from __future__ import annotations

import os

from redis import Redis
from rq import Queue

from ..record import record
from . import REDIS_URL_ENV

QUEUE = "bench"


def noop(job_id: str) -> None:
    record(job_id)


def enqueue_all(ids: list[str]) -> None:
    q = Queue(QUEUE, connection=Redis.from_url(os.environ[REDIS_URL_ENV]))
    for job_id in ids:
        q.enqueue(noop, job_id)
