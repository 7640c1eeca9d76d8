"""The workload's jobs and the check that each was delivered exactly once.

Every body is 100 bytes and unique within a run (it starts with a tag naming the figure and
run, then the job's index), so a delivered body names the job it came from. Keys cycle
through 1,000 values: ``k{i % 1000}``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from collections.abc import Iterable

from .peers.base import Item

BODY_BYTES = 100
KEYS = 1000
BATCH_JOBS = 100


def key_of(i: int) -> str:
    return f"k{i % KEYS}"


def make_items(tag: str, n: int) -> list[Item]:
    """``n`` (body, key) pairs whose bodies are unique to ``tag``."""
    items = []
    for i in range(n):
        head = f"{tag}:{i:09d}:".encode()
        items.append((head.ljust(BODY_BYTES, b"."), key_of(i)))
    return items


def batches(items: list, size: int = BATCH_JOBS) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def split(items: list, parts: int) -> list[list]:
    """``items`` dealt round-robin into ``parts`` lists."""
    return [items[p::parts] for p in range(parts)]


@dataclass(frozen=True)
class Delivery:
    """What a drain delivered, against what was enqueued."""

    expected: int
    delivered: int   # deliveries counted, duplicates included
    missing: int     # enqueued, never delivered
    duplicates: int  # deliveries beyond the first of a job
    unexpected: int  # delivered bodies that were never enqueued

    @property
    def exactly_once(self) -> bool:
        return self.missing == 0 and self.duplicates == 0 and self.unexpected == 0

    def to_dict(self) -> dict:
        return dict(asdict(self), exactly_once=self.exactly_once)

    def summary(self) -> str:
        if self.exactly_once:
            return "yes"
        return (f"no (missing {self.missing}, duplicates {self.duplicates}, "
                f"unexpected {self.unexpected})")


def check(expected: Iterable[bytes], delivered: Iterable[bytes]) -> Delivery:
    want = set(expected)
    counts = Counter(delivered)
    got = set(counts)
    return Delivery(
        expected=len(want),
        delivered=sum(counts.values()),
        missing=len(want - got),
        duplicates=sum(c - 1 for c in counts.values()),
        unexpected=len(got - want),
    )
