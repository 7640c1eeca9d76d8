"""Celery on Redis, late acks (``task_acks_late``: a job is acked after it ran, the setting
that survives a worker crash), no result backend. Worker:
``celery -A bench.workers.apps.celery_app worker --pool threads -c 8``.

The workflows figure (``bench/workflows.py``) runs ``chords`` instead, a second app on the
same Redis with Redis as its result backend too (a chord needs one):
``celery -A bench.workers.apps.celery_app:chords worker --pool threads -c 8``. It is not
made the current app, so Figure Wk's ``app`` is what it was."""
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


# The workflows figure: results kept in Redis (plain sends pass ignore_result=True).
chords = Celery("bench_wf", broker=os.environ[REDIS_URL_ENV], backend=os.environ[REDIS_URL_ENV],
                set_as_current=False)
chords.conf.update(task_acks_late=True, broker_connection_retry_on_startup=True)


@chords.task(name="bench.wf.noop", shared=False)  # not added to Figure Wk's app
def wf_noop(job_id: str) -> None:
    record(job_id)


@chords.task(name="bench.wf.done", shared=False)
def wf_done(results: list, job_id: str) -> int:
    """The chord's callback: records that it ran, returns how many member values it got."""
    record(job_id)
    return len(results)
