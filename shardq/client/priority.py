"""Queue-wide priorities over shards, as a pure plan (no I/O): which leases to keep.

A dequeue leases from one shard and, in the same round trip, asks every other shard which
priorities it has ready (``peek``). :func:`plan` then picks the ``max_jobs`` highest
priorities over all of them: leases in hand win ties (no churn, and the shard asked first
rotates per call, so equal priorities stay fair across shards); a lease that loses is
released unstarted (it costs no delivery); the jobs another shard must give come from a
second dequeue there. When every shard's best is the same priority (no priorities in use)
nothing is released and no second round trip is made.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class Plan(NamedTuple):
    keep: list[Any]      # leases to return
    release: list[Any]   # leases to hand back unstarted
    take: dict[int, int]  # shard -> how many jobs to dequeue there


def plan(held: Sequence[tuple[int, object]], peeks: dict[int, list[Any]], order: list[int], max_jobs: int) -> Plan:
    """``held``: (priority, lease) from the shard asked first; ``peeks``: shard ->
    ``[[priority, ready count], ...]`` (highest first) from the others; ``order``: the
    shards in this call's rotation (ties between other shards go in this order)."""
    rank = {s: i for i, s in enumerate(order)}
    cands = [(-prio, 0, 0, i) for i, (prio, _) in enumerate(held)]
    for shard, rows in peeks.items():
        left = max_jobs
        for prio, count in rows:
            n = min(count, left)
            cands.extend([(-prio, 1, rank.get(shard, len(order)), shard)] * n)
            left -= n
            if left <= 0:
                break
    cands.sort()
    top = cands[:max_jobs]
    kept = {c[3] for c in top if c[1] == 0}
    take: dict[int, int] = {}
    for c in top:
        if c[1] == 1:
            take[c[3]] = take.get(c[3], 0) + 1
    keep = [lease for i, (_, lease) in enumerate(held) if i in kept]
    release = [lease for i, (_, lease) in enumerate(held) if i not in kept]
    return Plan(keep, release, take)


def merge(keep: list[Any], held: Sequence[tuple[int, object]],
          taken: Sequence[Sequence[tuple[int, object]]]) -> list[Any]:
    """The leases a call returns: those it kept of ``held`` and those ``taken`` (``(priority,
    lease)`` per shard asked by the plan), highest priority first (stable)."""
    prio = {id(lease): p for p, lease in held}
    got = list(keep)
    for rows in taken:
        for p, lease in rows:
            got.append(lease)
            prio[id(lease)] = p
    got.sort(key=lambda lease: -prio[id(lease)])
    return got
