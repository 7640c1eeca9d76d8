"""Celery on kombu's SQS transport, unchanged, pointed at a real ``shardq serve`` with the SQS
listener on: a real ``celery worker`` process (started and ended by PID) runs N tasks sent by
a Celery producer, and every task's effect is seen exactly once (celery_app.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from support.service import wait_until
from support.sqs_clients import CREDENTIALS
from support.sqs_listener import client, sqs_service, sqs_url

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = 40

celery = pytest.importorskip("celery", reason="Celery is in the test extra: pip install -e '.[test]'")


def _effects(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM (Celery's warm shutdown), then SIGKILL; every process it started, by PID."""
    try:
        pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pids = [proc.pid]
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        rc = None
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
    return rc


def test_a_celery_worker_runs_every_task_once_through_the_sqs_listener(tmp_path):
    import celery_app

    effects = str(tmp_path / "effects.txt")
    with sqs_service() as svc:
        endpoint = sqs_url(svc).rstrip("/")
        producer = celery_app.make_app(endpoint, "celery-tasks", effects)
        for i in range(TASKS):  # sent before the worker starts: kombu creates the queue here
            producer.send_task("record", args=(i,))
        producer.close()

        env = dict(os.environ, SQS_ENDPOINT=endpoint, CELERY_QUEUE="celery-tasks", EFFECTS_PATH=effects,
                   PYTHONPATH=HERE, **CREDENTIALS)
        log = open(tmp_path / "worker.log", "wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "--pool", "threads", "-c", "4",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
            cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_until(lambda: len(_effects(effects)) >= TASKS or worker.poll() is not None, 90, 0.05,
                       "the worker to run every task")
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            # Acked (deleted) as well as run: nothing is left in the queue, visible or in flight.
            sqs = client(endpoint)
            url = sqs.get_queue_url(QueueName="celery-tasks")["QueueUrl"]

            def drained():
                a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
                return a["ApproximateNumberOfMessages"] == a["ApproximateNumberOfMessagesNotVisible"] == "0"
            wait_until(drained, 30, 0.05, "every task's message to be deleted")
        finally:
            rc = _stop(worker)
            log.close()
        assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]
        # The stopped worker's long poll (10 s) was pending on the listener: it must not take the next
        # message with it to the closed connection (it would stay invisible for the visibility timeout).
        sqs.send_message(QueueUrl=url, MessageBody="after the worker left")
        got = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5).get("Messages", [])
        assert [m["Body"] for m in got] == ["after the worker left"]
    assert sorted(_effects(effects)) == list(range(TASKS))
