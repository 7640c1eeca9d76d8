"""The Prometheus collector of ``shardq serve``: shard figures read at scrape time.

One scrape asks every shard for its first ``metrics_page`` at once, then the shards with
more queues for their next pages (8 MiB each), waiting at most ``timeout_s`` for each round
(:meth:`~shardq.client.router.Router.shard_metrics`); a shard that is down or slow shows
``shardq_shard_up 0`` and its queues are absent for that scrape. A scrape never fails
because of a shard. Restart counts and the last replay of a shard come from the
supervisor, so they are there while the shard is down.

Counters (``*_total``: prometheus-client adds the suffix to a counter family's name)
count since the shard process started (queue, results and workflow counters) or since
``shardq serve`` started (restarts): both reset on a restart, which ``rate()`` handles.
The metric names and labels are listed in docs/operations.md ("Metrics").
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..clock import Clock, SystemClock
from ..shard.control import COUNTERS

if TYPE_CHECKING:
    from ..client.router import Router
    from .supervisor import Supervisor

F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)

QUEUE_STATES = ("ready", "delayed", "waiting", "in_flight", "dead")
_COUNTER_HELP = {
    "enqueued": "jobs enqueued (dedup hits not counted)",
    "leased": "leases handed out (deliveries)",
    "acked": "jobs acked (done)",
    "nacked": "deliveries nacked (failed and released, with or without delay)",
    "lease_expiries": "leases that ran out before an ack or nack",
    "dead_lettered": "jobs moved to the dead-letter queue",
    "redriven": "dead letters moved back into the queue",
    "cancelled": "jobs cancelled (ready, delayed, waiting, leased or dead)",
    "purged": "jobs deleted by a purge (of the queue, of its dead letters, or of chosen dead letters)",
}


#: The limit figures of a queue's ``stats`` exported as gauges (shardq_queue_limit_<key>).
_LIMIT_HELP = {
    "in_flight": "leases of the limited queue live on this shard (what concurrency caps)",
    "concurrency": "the queue's concurrency cap in force",
    "max_in_flight_seen": "the most leases of the queue live at once since the shard started",
    "tokens": "tokens in the queue's rate bucket now",
    "rate_per_s": "the queue's rate in force, leases per second",
    "burst": "the most tokens the queue's bucket holds",
    "held_back": "ready jobs a limit holds back now (not leased, not counted as deliveries)",
    "groups": "groups of the queue with ready or leased jobs (or a refilling bucket)",
    "groups_held_back": "groups a limit holds back now",
    "group_concurrency": "the per-group concurrency cap in force",
    "max_group_in_flight_seen": "the most leases of one group live at once since the shard started",
    "group_rate_per_s": "the per-group rate in force, leases per second",
    "fenced_until": "Unix time before which the placed queue leases nothing, after a power cut "
                    "(present only then: docs/limits.md)",
}

#: The workflow counters of a shard's ``metrics`` reply (shard/results.py,
#: ``workflow_counters``), as (metric name, help); each counts since the shard started.
_WORKFLOW_COUNTERS = {
    "results_stored": ("shardq_results_stored", "results stored by workers (a result stored again, "
                                                "by a second delivery, counts again), since the shard started"),
    "barriers_fired": ("shardq_workflow_barriers_fired", "workflow barriers fired: callbacks enqueued "
                                                         "(workflow steps started by their barrier), "
                                                         "since the shard started"),
    "barriers_cancelled": ("shardq_workflow_barriers_cancelled", "workflow barriers cancelled before they "
                                                                 "fired, since the shard started"),
    "workflows_started": ("shardq_workflows_started", "workflows sent (their records kept on this, their "
                                                      "home shard), since the shard started"),
    "workflows_succeeded": ("shardq_workflows_succeeded", "workflows whose every final step succeeded "
                                                          "(recorded by the service's watcher), since the "
                                                          "shard started"),
    "workflows_failed": ("shardq_workflows_failed", "workflows with a step dead-lettered (recorded by the "
                                                    "service's watcher), since the shard started"),
    "workflows_cancelled": ("shardq_workflows_cancelled", "workflows cancelled (wf.cancel(), or a final "
                                                          "step's result gone), since the shard started"),
}
BARRIER_STATES = ("open", "fired", "cancelled")
WORKFLOW_STATES = ("running", "succeeded", "failed", "cancelled")


class ShardqCollector:
    """Registered in a ``CollectorRegistry``; ``collect()`` runs on every scrape."""

    def __init__(self, router: Router, supervisor: Supervisor | None = None, timeout_s: float = 2.0,
                 clock: Clock | None = None):
        self.router = router
        self.supervisor = supervisor
        self.timeout_s = timeout_s
        self.clock = clock or SystemClock()  # times the scrape

    def describe(self) -> list[Metric]:
        return []  # no scrape at registration time

    def collect(self) -> Iterable[Metric]:
        t0 = self.clock.monotonic()
        shards = self.router.shard_metrics(self.timeout_s)
        handles = self.supervisor.handles if self.supervisor is not None else []
        g = _Families()
        for sh in shards:
            s = str(sh["shard"])
            up = bool(sh.get("available"))
            g.gauge("shardq_shard_up", "1 if the shard answered this scrape, else 0", [s], 1 if up else 0)
            h = handles[sh["shard"]] if sh["shard"] < len(handles) else None
            if h is not None:
                g.counter("shardq_shard_restarts", "restarts of the shard since shardq serve started", [s],
                          h.restarts)
                g.gauge("shardq_shard_failed", "1 if the shard is left down: a corrupt log (every other "
                        "failure is restarted, with backoff)", [s], 1 if h.status == "failed" else 0)
                g.gauge("shardq_shard_status", "1, labelled with the shard's status (starting, ready, "
                        "restarting, failed) and why it is not ready (disk_full, corrupt_log, hung, log_failed, "
                        "io_error, exit; empty when ready)", [s, h.status, h.reason_kind or ""], 1,
                        names=["shard", "status", "reason"])
            replay_s = sh.get("replay_seconds", (h.ready_info.get("replay_s") if h else None))
            replay_n = sh.get("replay_records", (h.ready_info.get("records") if h else None))
            if replay_s is not None:
                g.gauge("shardq_shard_replay_seconds", "seconds the shard's last start spent replaying its "
                        "log", [s], replay_s)
                g.gauge("shardq_shard_replay_records", "log records replayed at the shard's last start", [s],
                        replay_n or 0)
            if not up:
                continue
            g.gauge("shardq_shard_wal_bytes", "bytes of log records written: the checkpoint and the segments "
                    "since it (what compaction weighs)", [s], sh["wal_bytes"])
            g.gauge("shardq_shard_wal_disk_bytes", "bytes the shard's log files take on disk (allocated "
                    "blocks, the newest segment's preallocated space included): alert on this", [s],
                    sh.get("wal_disk_bytes", 0))
            g.gauge("shardq_shard_wal_segments", "log segments since the last checkpoint", [s], sh["segments"])
            g.counter("shardq_shard_compactions", "log compactions (checkpoints) since the shard started", [s],
                      sh["compactions"])
            g.gauge("shardq_shard_clients", "connected clients", [s], sh["clients"])
            g.gauge("shardq_shard_clients_max", "connected clients the shard holds at most "
                    "(limits.max_connections)", [s], sh["clients_max"])
            g.counter("shardq_shard_clients_turned_away", "clients turned away at the connection limit "
                      "(TooManyConnections), since the shard started", [s], sh["clients_turned_away"])
            g.counter("shardq_shard_loop_iterations", "iterations of the shard's event loop", [s],
                      sh["iterations"])
            g.gauge("shardq_shard_jobs", "live jobs on the shard (every state)", [s], sh["jobs"])
            _workflows(g, s, sh)
            for key, name, doc in (("commit_seconds", "shardq_shard_commit_seconds",
                                    "time of one log commit: write and fdatasync"),
                                   ("commit_ops", "shardq_shard_commit_ops",
                                    "log operations (jobs enqueued, leased, acked, ...) made durable by one "
                                    "fsync")):
                if key in sh:
                    g.histogram(name, doc, [s], sh[key])
            counts = sh.get("queues", {})
            for qname, fig in sh.get("queue_metrics", {}).items():
                labels = [qname, s]
                c = counts.get(qname, {})
                for state in QUEUE_STATES:
                    g.gauge("shardq_queue_jobs", "jobs of the queue by state (waiting: behind their key's "
                            "head; in_flight: leased)", labels + [state], c.get(state, 0),
                            names=["queue", "shard", "state"])
                g.gauge("shardq_queue_keys", "keys with jobs", labels, c.get("keys", 0), names=["queue", "shard"])
                g.gauge("shardq_queue_paused", "1 if the queue is paused (leases nothing)", labels,
                        1 if fig["paused"] else 0, names=["queue", "shard"])
                g.gauge("shardq_queue_oldest_ready_age_seconds", "how long the first ready job in line has "
                        "been due (0: none ready)", labels, fig["oldest_ready_age_s"] or 0.0,
                        names=["queue", "shard"])
                for counter in COUNTERS:
                    g.counter(f"shardq_queue_{counter}", _COUNTER_HELP[counter] + ", since the shard started",
                              labels, fig[counter], names=["queue", "shard"])
                for key, value in (c.get("limits") or {}).items():  # a limited queue (docs/limits.md)
                    if key in _LIMIT_HELP:
                        g.gauge(f"shardq_queue_limit_{key}", _LIMIT_HELP[key], labels, value,
                                names=["queue", "shard"])
        g.gauge("shardq_scrape_duration_seconds", "time this scrape took to read every shard", [],
                self.clock.monotonic() - t0, names=[])
        yield from g.families.values()


def _workflows(g: _Families, s: str, sh: dict[str, Any]) -> None:
    """A shard's results and workflow figures (docs/workflows.md): what it keeps now
    (``stats``: ``results``, ``barriers``), and what it did since it started
    (``workflow_counters``). A figure the reply lacks adds no series."""
    if "results" in sh:
        g.gauge("shardq_results_kept", "job results the shard keeps (until their keep_result expiry)", [s],
                sh["results"])
    _by_state(g, s, "shardq_workflow_barriers", "workflow barriers the shard keeps, by state: open (waiting "
              "for members), fired and cancelled (kept as tombstones until they expire)",
              BARRIER_STATES, sh.get("barriers"))
    _by_state(g, s, "shardq_workflows", "workflow records this home shard keeps, by state: running, and "
              "succeeded, failed or cancelled (kept a day after they ended)", WORKFLOW_STATES, sh.get("workflows"))
    for key, value in (sh.get("workflow_counters") or {}).items():
        if key in _WORKFLOW_COUNTERS:
            name, doc = _WORKFLOW_COUNTERS[key]
            g.counter(name, doc, [s], value)


def _by_state(g: _Families, s: str, name: str, doc: str, states: tuple[str, ...],
              counts: dict[str, int] | None) -> None:
    """One gauge series per state the reply counts (labels shard, state)."""
    for state in states:
        if counts and state in counts:
            g.gauge(name, doc, [s, state], counts[state], names=["shard", "state"])


class _Families:
    """Metric families by name, created on first use with their label names."""

    def __init__(self) -> None:
        self.families: dict[str, Any] = {}  # name -> its Gauge-, Counter- or HistogramMetricFamily

    def _family(self, cls: type[F], name: str, doc: str, names: list[str]) -> F:
        fam: F | None = self.families.get(name)
        if fam is None:
            fam = self.families[name] = cls(name, doc, labels=names)
        return fam

    def gauge(self, name: str, doc: str, labels: list[str], value: float,
              names: Sequence[str] = ("shard",)) -> None:
        self._family(GaugeMetricFamily, name, doc, list(names)).add_metric(labels, value)

    def counter(self, name: str, doc: str, labels: list[str], value: float,
                names: Sequence[str] = ("shard",)) -> None:
        self._family(CounterMetricFamily, name, doc, list(names)).add_metric(labels, value)

    def histogram(self, name: str, doc: str, labels: list[str], snap: dict[str, Any],
                  names: Sequence[str] = ("shard",)) -> None:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip(snap["bounds"] + [float("inf")], snap["counts"]):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        self._family(HistogramMetricFamily, name, doc, list(names)).add_metric(labels, buckets, snap["sum"])
