"""What one run of the benchmark does to one peer: the sizes, and the figure groups.

A group is a few figures that share one freshly set-up peer: A then C (C drains what A
enqueued), B then C2, and so on. Figures S (scaling.py) and Wk (workers/) are not played
per peer: run.py runs them after the peers. Each group starts from an empty queue in a new tmp dir, so
no figure sees another's jobs. A group that does not apply to a peer (no batch operations)
marks its figures "n/a".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from . import latency, mpmc, workloads
from .jobs import make_items
from .peers.base import Adapter

LATENCY_RATES_PER_S = (500, 5000)
#: The batched figures (B, C2, D2) move this many times ``jobs``: at 10,000 a shardq B run is 100 calls
#: in about 60 ms, where one slow fsync or start-up cost moved the median by 30% (Redis's B 96k-138k/s
#: within one run); 100,000 take about a second.
BATCHED_SCALE = 10


@dataclass(frozen=True)
class Settings:
    jobs: int
    runs: int
    stall_s: float         # a drain stops when no job came for this long
    deadline_s: float      # the longest a multi-process figure may take
    paced_s: float         # figure L offers jobs for this long at each rate (at most `jobs`)
    wake_samples: int      # figure W
    idle_s: float          # figure W: idle CPU is read over this long
    physical_s: float      # each physical limit is measured for this long
    scaling: bool          # figure S (its cells use `jobs`; see scaling.py)
    wk_jobs: int           # figure Wk: no-op jobs per worker runner and run
    wk_deadline_s: float   # figure Wk: the longest one runner may take to drain them
    wk_settle_s: float     # figure Wk: after the last job ran, wait this long for duplicates

    @property
    def batched_jobs(self) -> int:
        """Jobs of the batched figures (B, C2, D2): ``BATCHED_SCALE`` times ``jobs``."""
        return self.jobs * BATCHED_SCALE

    @classmethod
    def full(cls) -> Settings:
        return cls(jobs=10_000, runs=3, stall_s=10.0, deadline_s=300.0, paced_s=2.0,
                   wake_samples=200, idle_s=1.0, physical_s=1.0, scaling=True,
                   wk_jobs=20_000, wk_deadline_s=1800.0, wk_settle_s=1.0)

    @classmethod
    def quick(cls) -> Settings:
        return cls(jobs=500, runs=1, stall_s=5.0, deadline_s=60.0, paced_s=0.4,
                   wake_samples=20, idle_s=0.5, physical_s=0.2, scaling=False,
                   wk_jobs=200, wk_deadline_s=60.0, wk_settle_s=0.3)


Record = Callable[[str, dict], None]


def _a_c(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "A", s.jobs)
    record("A", workloads.enqueue_single(adapter, items))
    record("C", workloads.drain(adapter, items, batch=False, stall_s=s.stall_s))


def _b_c2(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "B", s.batched_jobs)
    record("B", workloads.enqueue_batched(adapter, items))
    record("C2", workloads.drain(adapter, items, batch=True, stall_s=s.stall_s))


def _b_threads(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "T", s.jobs)
    record("B-threads", workloads.enqueue_threads(adapter, items))


def _d(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "D", s.jobs)
    record("D", mpmc.run(adapter, items, batch=False, stall_s=s.stall_s,
                         deadline_s=s.deadline_s))


def _d2(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "E", s.batched_jobs)
    record("D2", mpmc.run(adapter, items, batch=True, stall_s=s.stall_s,
                          deadline_s=s.deadline_s))


def _m(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "M", s.jobs)
    record("M", mpmc.run(adapter, items, batch=False, stall_s=s.stall_s,
                         deadline_s=s.deadline_s, producers=mpmc.MANY_PRODUCERS,
                         consumers=mpmc.MANY_CONSUMERS))


def _l(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    for rate in LATENCY_RATES_PER_S:
        count = min(s.jobs, max(1, int(rate * s.paced_s)))
        items = make_items(f"{tag}L{rate}", count)
        record(f"L@{rate}", latency.paced_enqueue(adapter, items, rate,
                                                   time_cap_s=max(5 * s.paced_s, 2.0)))


def _w(adapter: Adapter, s: Settings, tag: str, record: Record) -> None:
    items = make_items(tag + "W", s.wake_samples)
    record("W", latency.wake_up(adapter, items, idle_s=s.idle_s, timeout_s=s.deadline_s))


def _has_batch(adapter: Adapter) -> str | None:
    return None if adapter.batch_mode else "no batch operations"


def _is_shardq(adapter: Adapter) -> str | None:
    return None if adapter.name == "shardq" else "shardq only"


@dataclass(frozen=True)
class Group:
    figures: tuple[str, ...]
    play: Callable[[Adapter, Settings, str, Record], None]
    not_applicable: Callable[[Adapter], str | None] = lambda adapter: None


GROUPS = (
    Group(("A", "C"), _a_c),
    Group(("B", "C2"), _b_c2, _has_batch),
    Group(("B-threads",), _b_threads, _is_shardq),
    Group(("D",), _d),
    Group(("D2",), _d2, _has_batch),
    Group(("M",), _m),
    Group(tuple(f"L@{r}" for r in LATENCY_RATES_PER_S), _l),
    Group(("W",), _w),
)


OTHER_FIGURES = ("S", "Wk")  # not played per peer: see run.py


def figure_names() -> list[str]:
    """What ``--figures`` takes: each group's figures, L for both L@ rates, S and Wk."""
    names = []
    for group in GROUPS:
        for figure in group.figures:
            name = figure.split("@")[0]
            if name not in names:
                names.append(name)
    return names + list(OTHER_FIGURES)


def selected_groups(names: set[str]) -> list[Group]:
    """The groups that play at least one of the figures ``names`` (as figure_names gives
    them): a group's figures play together, as they share a queue."""
    return [g for g in GROUPS if any(f.split("@")[0] in names for f in g.figures)]


def describe(figure: str, result: dict[str, Any]) -> str:
    """One progress line's worth of ``result``."""
    if "error" in result:
        return f"error: {result['error']}"
    if "na" in result:
        return f"n/a ({result['na']})"
    parts = []
    if "jobs_per_s" in result:
        parts.append(f"{result['jobs_per_s']:,.0f} jobs/s")
    if "latency_ms" in result:
        lat, call = result["latency_ms"], result["call_ms"]
        parts.append(f"latency p50 {lat['p50']:.2f} p99 {lat['p99']:.2f} ms, call p99 "
                     f"{call['p99']:.2f} ms, achieved {result['achieved_per_s']:,.0f}/s")
    if "wake_ms" in result:
        w, cpu = result["wake_ms"], result["idle_cpu_percent"]
        parts.append(f"wake p50 {w['p50']:.2f} p99 {w['p99']:.2f} ms, idle CPU consumer "
                     f"{cpu['consumer']:.1f}% server {cpu['server']}%")
    if "mode" in result:
        parts.append(result["mode"])
    if "delivery" in result:
        d = result["delivery"]
        parts.append("exactly once" if d["exactly_once"] else
                     f"NOT exactly once: missing {d['missing']}, dup {d['duplicates']}, "
                     f"unexpected {d['unexpected']}")
    return ", ".join(parts)
