"""Dramatiq on Redis (``RedisBroker``; Dramatiq acks a message after its actor ran), default
middleware. Worker: ``dramatiq bench.workers.apps.dramatiq_app --processes 1 --threads 8``."""
from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from ..record import record
from . import REDIS_URL_ENV

dramatiq.set_broker(RedisBroker(url=os.environ[REDIS_URL_ENV]))


@dramatiq.actor(actor_name="bench_noop")
def noop(job_id: str) -> None:
    record(job_id)


def enqueue_all(ids: list[str]) -> None:
    for job_id in ids:
        noop.send(job_id)
