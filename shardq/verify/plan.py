"""The fault schedule of a chaos run, drawn from the seed alone, before the run starts.

What the seed fixes: every fault's kind, order, planned time, target (shard or worker
index), pause length, and the page choices of a power cut. So two runs with one seed inject
the same faults (:func:`fingerprint` of the plan is printed to compare). What it cannot fix:
the interleaving of real processes. Which jobs are in flight when a fault lands, how many
jobs the producers get through, which lease a worker stalls on, and so every count in the
report, differ from run to run. A fault is injected at its planned time or, when the one
before it took longer (a service restart), as soon as that one is done; a shard that is not
running at that moment (restarting after an earlier fault) is skipped, and the report says
how many were.
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import astuple, dataclass

#: Faults against our own service and the workers, in the order a round is dealt from.
SERVICE_KINDS = ("kill_shard", "kill_service", "kill_worker", "pause_shard", "pause_worker")
WORKER_KINDS = ("kill_worker", "pause_worker")  # against a backend that is not ours (--target)
POWER_CUT = "power_cut"
KILL_PRODUCER = "kill_producer"   # only with --kill-producers: other seeds' plans stay as they were
#: A shard pause outlives the health timeout (the supervisor kills it as hung) this often.
HUNG_FRACTION = 0.25
#: The most faults :func:`plan` plans (``duration_s / interval_s``; ``shardq verify``
#: refuses more first, naming its options: :mod:`.options`).
FAULTS_MAX = 1_000_000


@dataclass(frozen=True)
class Fault:
    at_s: float                  # planned time, seconds after the schedule starts
    kind: str
    target: int | None = None    # shard (kill_shard, pause_shard), worker or producer index
    seconds: float = 0.0         # how long a pause lasts
    hung: bool = False           # a shard pause past the health timeout
    seed: int = 0                # power_cut: the seed of its page choices


def kinds_for(*, target: bool, power_cuts: bool, kill_producers: bool = False) -> tuple[str, ...]:
    producers = (KILL_PRODUCER,) if kill_producers else ()
    if target:
        return WORKER_KINDS + producers
    return SERVICE_KINDS + ((POWER_CUT,) if power_cuts else ()) + producers


def plan(seed: int, kinds: tuple[str, ...], *, duration_s: float, interval_s: float, shards: int, workers: int,
         visibility_s: float, health_timeout_s: float, producers: int = 1) -> tuple[list[Fault], float]:
    """The faults of a run and when the schedule ends. Rounds deal every kind once, in
    shuffled order, spaced by ``interval_s × U(0.5, 1.5)``; faults are planned until
    ``duration_s`` and at least one whole round is. Every fault draws the same random
    numbers whatever its kind uses, so a plan never depends on anything but its inputs.
    ValueError for an ``interval_s`` that is not a finite number above 0 (the loop would
    never end), a ``duration_s`` that is not finite and at least 0, no ``kinds``, or a plan
    of more than :data:`FAULTS_MAX` faults."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s must be a finite number above 0, got {interval_s!r}")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be a finite number, 0 or more, got {duration_s!r}")
    if not kinds:
        raise ValueError("kinds: no kind of fault to plan")
    if duration_s / interval_s > FAULTS_MAX:
        raise ValueError(f"duration_s / interval_s: more than {FAULTS_MAX:,} faults "
                         f"({duration_s!r} / {interval_s!r})")
    rng = random.Random(f"{seed}/schedule")
    t = rng.uniform(0.5, 1.0) * interval_s
    faults: list[Fault] = []
    deck: list[str] = []
    while t < duration_s or len(faults) < len(kinds):
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        shard, worker = rng.randrange(shards), rng.randrange(workers)
        u_hung, u_len, page_seed = rng.random(), rng.random(), rng.randrange(2**32)
        if kind == "pause_shard":
            hung = u_hung < HUNG_FRACTION
            lo, hi = 1.5 * visibility_s, 0.8 * health_timeout_s
            seconds = health_timeout_s * 1.5 if hung else lo + (hi - lo) * u_len
            faults.append(Fault(round(t, 3), kind, shard, round(seconds, 3), hung))
        elif kind == "pause_worker":
            faults.append(Fault(round(t, 3), kind, worker, round(visibility_s * (1.5 + 1.5 * u_len), 3)))
        elif kind == "kill_shard":
            faults.append(Fault(round(t, 3), kind, shard))
        elif kind == "kill_worker":
            faults.append(Fault(round(t, 3), kind, worker))
        elif kind == POWER_CUT:
            faults.append(Fault(round(t, 3), kind, seed=page_seed))
        elif kind == KILL_PRODUCER:  # its target from a number every fault draws anyway
            faults.append(Fault(round(t, 3), kind, page_seed % producers))
        else:
            faults.append(Fault(round(t, 3), kind))
        t += rng.uniform(0.5, 1.5) * interval_s
    # Faults stop at the duration; a first round that runs past it gets one more gap.
    return faults, (t if faults[-1].at_s >= duration_s else duration_s)


def fingerprint(faults: Sequence[Fault | DiskFault]) -> str:
    """A short digest of a plan: equal for two runs with the same seed and arguments."""
    return hashlib.sha256(repr([astuple(f) for f in faults]).encode()).hexdigest()[:12]


#: ``--disk-faults``: the damage to synced log data (:mod:`.diskfaults`), and where.
DISK_KINDS = ("zero_sector", "zero_page", "bit_flip", "misdirected")
DISK_TARGETS = ("newest_segment", "sealed_segment", "checkpoint")


@dataclass(frozen=True)
class DiskFault:
    kind: str
    target: str
    seed: int      # the draws of its shard, file and positions


def disk_plan(seed: int, per_kind: int) -> list[DiskFault]:
    """``per_kind`` faults of each kind, in seeded order; kind ``k``'s ``i``-th fault hits
    target ``(i + k) % 3``, so from 3 per kind on every kind meets every target."""
    rng = random.Random(f"{seed}/disk-faults")
    faults = [DiskFault(kind, DISK_TARGETS[(i + k) % len(DISK_TARGETS)], rng.randrange(2**32))
              for i in range(per_kind) for k, kind in enumerate(DISK_KINDS)]
    rng.shuffle(faults)
    return faults
