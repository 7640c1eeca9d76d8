"""Prometheus metrics of a worker process (``shardq worker --metrics HOST:PORT``).

* ``shardq_worker_jobs_total{task, outcome}``: jobs this worker finished; outcome is
  ``done`` (handler ran, acked), ``duplicate`` (already processed: skipped, acked),
  ``failed`` (handler raised: nacked with backoff, or dead-lettered), ``lost`` (the lease was lost or the
  job cancelled: not acked), ``expired`` (its lease ended before it started: not run).
* ``shardq_worker_handler_seconds{task}``: how long the handler ran (with its
  idempotency transaction), a histogram.
* ``shardq_worker_in_flight``: leases held (running and prefetched).

``task`` is the handler's name (``module:function``) unless ``task_of`` names each job's
task (a task layer dispatching many functions from one worker). The listener serves only
these read-only figures: nothing can be changed through it.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..config import split_listen
from ..types import Lease

#: WorkerStats counter -> outcome label.
OUTCOMES = {"succeeded": "done", "duplicates": "duplicate", "failed": "failed", "lost": "lost",
            "expired": "expired"}
HANDLER_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                           60.0, 300.0)


class WorkerMetrics:
    def __init__(self, task: str = "handler", task_of: Callable[[Lease], str] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.task_of = task_of or (lambda lease: task)
        self._in_flight_fns: list[Callable[[], int]] = []
        self.jobs = Counter("shardq_worker_jobs", "jobs finished by this worker, by task and outcome",
                            ["task", "outcome"], registry=self.registry)
        self.handler_seconds = Histogram("shardq_worker_handler_seconds", "time the handler ran (with its "
                                         "idempotency transaction)", ["task"], registry=self.registry,
                                         buckets=HANDLER_SECONDS_BUCKETS)
        self.in_flight = Gauge("shardq_worker_in_flight", "leases this worker holds (running and prefetched)",
                               registry=self.registry)

    def count_in_flight(self, fn: Callable[[], int]) -> None:
        """Add a worker's count of held leases (one process may run a worker per queue)."""
        self._in_flight_fns.append(fn)
        self.in_flight.set_function(lambda: sum(f() for f in self._in_flight_fns))

    def finished(self, lease: Lease, counter: str) -> None:
        outcome = OUTCOMES.get(counter)
        if outcome is not None:
            self.jobs.labels(self.task_of(lease), outcome).inc()

    def handled(self, lease: Lease, seconds: float) -> None:
        self.handler_seconds.labels(self.task_of(lease)).observe(seconds)

    def serve(self, listen: str) -> tuple[str, int]:
        """Serve ``/metrics`` on ``listen`` (``host:port``; port 0 = any free port) on a daemon
        thread; returns the address bound."""
        host, port = split_listen(listen, "--metrics")
        server, _thread = start_http_server(port, host, registry=self.registry)
        address: tuple[str, int] = server.server_address[:2]  # type: ignore[assignment]  # an AF_INET(6) server: str host
        return address
