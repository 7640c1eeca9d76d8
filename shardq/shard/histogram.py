"""A fixed-bucket histogram for figures the shard process reports (commit latency, operations
per commit) without depending on a metrics library: the HTTP side turns a snapshot into a
Prometheus histogram.

One thread writes (the committer); readers take a :meth:`Histogram.snapshot`, which may be
one observation behind, never torn in a way that matters for a metric.
"""
from __future__ import annotations

import bisect
from typing import TypedDict

#: fsync latency, seconds: 100 µs (a write-back cache) to 2.5 s (a disk in trouble).
COMMIT_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                          0.1, 0.25, 0.5, 1.0, 2.5)
#: log operations made durable by one fsync (group commit), 1 to 16,384.
COMMIT_OPS_BUCKETS = tuple(float(2 ** i) for i in range(15))
_bisect_left = bisect.bisect_left


class Snapshot(TypedDict):
    """What :meth:`Histogram.snapshot` returns (the shard sends it to the HTTP side as is)."""
    bounds: list[float]
    counts: list[int]   # per bucket, +Inf last
    sum: float
    count: int


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # per bucket; the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[_bisect_left(self.bounds, value)] += 1  # upper bounds are inclusive
        self.sum += value

    @property
    def count(self) -> int:
        """Values observed (the buckets' total: not counted apart on every observation)."""
        return sum(self.counts)

    def snapshot(self) -> Snapshot:
        """``{"bounds": [...], "counts": [...per bucket, +Inf last], "sum": s, "count": n}``."""
        counts = list(self.counts)
        return {"bounds": list(self.bounds), "counts": counts, "sum": self.sum, "count": sum(counts)}
