"""A tiny Celery app on kombu's SQS transport, pointed at shardq's SQS listener
(tests/sqs_clients/test_celery.py starts ``celery -A celery_app worker`` on it).

The endpoint comes from the broker URL's host and port (kombu builds ``http://HOST:PORT`` when
``is_secure`` is false); the queue is created by kombu (GetQueueUrl, then CreateQueue) on first
use. Each task appends its number to a file, one ``os.write`` of an O_APPEND descriptor, so
the test sees every run, duplicates included.
"""
from __future__ import annotations

import os

from celery import Celery


def make_app(endpoint: str, queue: str, effects_path: str) -> Celery:
    host_port = endpoint.removeprefix("http://")
    app = Celery("celery_app", broker=f"sqs://test:test@{host_port}")
    app.conf.update(
        broker_transport_options={
            "is_secure": False,          # http://, the listener is on loopback
            "region": "us-east-1",
            "wait_time_seconds": 10,     # long polls, as Celery's docs set them: one is pending when the worker stops
            "polling_interval": 0.1,
            "visibility_timeout": 60,
        },
        task_default_queue=queue,
        task_ignore_result=True,
        task_acks_late=True,             # delete after the task ran, not before
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )

    @app.task(name="record")
    def record(i: int) -> None:
        fd = os.open(effects_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)

    return app


app = make_app(os.environ.get("SQS_ENDPOINT", "http://127.0.0.1:9324"), os.environ.get("CELERY_QUEUE", "celery"),
               os.environ.get("EFFECTS_PATH", "effects.txt"))
