"""The worker runners of figure Wk, and the brokers each one runs on.

A runner is a framework's own worker command, as its documentation starts it, at 8-way
concurrency in one process. Each runs every broker setting listed for it; a (runner,
broker) pair is one row of the figure, named ``runner@broker``:

* ``shardq``       ``shardq worker --concurrency 8 --mode thread`` on ``shardq serve``
* ``shardq-idem``  the same with ``--idempotency PATH.sqlite`` (exactly-once effects)
* ``celery``       ``celery worker --pool threads -c 8``, ``task_acks_late=True``
* ``dramatiq``     ``dramatiq --processes 1 --threads 8``
* ``rq``           ``rq worker`` (forks a work horse per job)
* ``rq-simple``    ``rq worker -w rq.SimpleWorker`` (runs jobs in the worker process)
* ``huey``         ``huey_consumer -k thread -w 8``, on Redis and on SQLite

Brokers: ``shardq`` (fsync before every reply), ``redis-always`` (AOF, ``appendfsync
always``: every write fsynced, the setting equal to shardq's), ``redis-default`` (Redis's
defaults: RDB snapshots now and then, no AOF, so a crash loses the jobs written since the
last snapshot), ``sqlite`` (Huey's SQLite storage with ``fsync=True``).

Logging is at WARNING for every runner that has a switch for it (rq and Huey log every job
at their default level), so the figure measures the queue, not the log.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

CONCURRENCY = 8
APPS = "bench.workers.apps"
REDIS_BROKERS = ("redis-default", "redis-always")


@dataclass(frozen=True)
class Runner:
    name: str                    # what --runners takes
    command: str                 # the worker command, as a user types it (for the report)
    app: str                     # module under bench.workers.apps with enqueue_all
    modules: tuple[str, ...]     # Python modules it needs (else it is skipped)
    brokers: tuple[str, ...]     # the broker settings it is run on
    argv: Callable[[dict], list[str]]  # the worker's argv, given the broker's settings
    adds: str = ""               # durability the runner adds to its broker's, in words


def _shardq(idempotent: bool) -> Callable[[dict], list[str]]:
    def argv(b: dict) -> list[str]:
        out = [sys.executable, "-m", "shardq.cli", "worker", f"{APPS}.shardq_app:noop",
               "--data-dir", b["data_dir"], "--concurrency", str(CONCURRENCY),
               "--mode", "thread", "--log-level", "WARNING"]
        return out + ["--idempotency", b["idempotency_path"]] if idempotent else out
    return argv


def _celery(b: dict) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", f"{APPS}.celery_app", "worker",
            "--pool", "threads", "--concurrency", str(CONCURRENCY), "--loglevel", "WARNING"]


def _dramatiq(b: dict) -> list[str]:
    return [sys.executable, "-m", "dramatiq", f"{APPS}.dramatiq_app",
            "--processes", "1", "--threads", str(CONCURRENCY)]


def _rq(worker_class: str | None) -> Callable[[dict], list[str]]:
    def argv(b: dict) -> list[str]:
        out = [sys.executable, "-m", "rq.cli", "worker", "--url", b["redis_url"], "--quiet"]
        if worker_class:
            out += ["--worker-class", worker_class]
        return out + ["bench"]  # rq_app.QUEUE
    return argv


def _huey(b: dict) -> list[str]:
    return [sys.executable, "-m", "huey.bin.huey_consumer", f"{APPS}.huey_app.huey",
            "--worker-type", "thread", "--workers", str(CONCURRENCY), "--quiet"]


RUNNERS: dict[str, Runner] = {r.name: r for r in (
    Runner("shardq", "shardq worker --concurrency 8 --mode thread", "shardq_app",
           ("shardq",), ("shardq",), _shardq(False)),
    Runner("shardq-idem", "shardq worker --concurrency 8 --mode thread --idempotency S.sqlite",
           "shardq_app", ("shardq",), ("shardq",), _shardq(True),
           adds="+ idempotency store: SQLite WAL, synchronous=FULL"),
    Runner("celery", "celery worker --pool threads -c 8 (task_acks_late)", "celery_app",
           ("celery", "redis"), REDIS_BROKERS, _celery),
    Runner("dramatiq", "dramatiq --processes 1 --threads 8", "dramatiq_app",
           ("dramatiq", "redis"), REDIS_BROKERS, _dramatiq),
    Runner("rq", "rq worker (fork per job)", "rq_app", ("rq", "redis"), REDIS_BROKERS,
           _rq(None)),
    Runner("rq-simple", "rq worker -w rq.SimpleWorker", "rq_app", ("rq", "redis"),
           REDIS_BROKERS, _rq("rq.SimpleWorker")),
    Runner("huey", "huey_consumer -k thread -w 8", "huey_app", ("huey", "redis"),
           (*REDIS_BROKERS, "sqlite"), _huey),
)}


def variants(names: list[str]) -> list[tuple[Runner, str]]:
    """(runner, broker) for each name, in RUNNERS order: a runner's name gives each broker
    of it; ``runner@broker`` gives that one."""
    return [(r, b) for r in RUNNERS.values() for b in r.brokers
            if r.name in names or variant_name(r, b) in names]


def known_names() -> list[str]:
    """Every name ``variants`` takes."""
    return list(RUNNERS) + [variant_name(r, b) for r in RUNNERS.values() for b in r.brokers]


def variant_name(runner: Runner, broker: str) -> str:
    return f"{runner.name}@{broker}"
