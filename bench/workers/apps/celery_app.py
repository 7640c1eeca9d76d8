"""Celery on Redis, late acks (``task_acks_late``: a job is acked after it ran, the setting
that survives a worker crash), no result backend. Worker:
``celery -A bench.workers.apps.celery_app worker --pool threads -c 8``."""
from __future__ import annotations

import os

from celery import Celery

from ..record import record
from . import REDIS_URL_ENV

app = Celery("bench_wk", broker=os.environ[REDIS_URL_ENV])
app.conf.update(task_acks_late=True, task_ignore_result=True,
                broker_connection_retry_on_startup=True)


@app.task(name="bench.noop")
def noop(job_id: str) -> None:
    record(job_id)


def enqueue_all(ids: list[str]) -> None:
    for job_id in ids:
        noop.delay(job_id)
