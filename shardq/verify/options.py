"""The options of ``shardq verify`` (:func:`build_parser`) and the defaults that depend on
others or on chance (:func:`settle_defaults`): a module of their own, so that the run's
replay command (run.py) reads them without importing the package that imports the run."""
from __future__ import annotations

import argparse
import math
import random

from ..errors import UsageError
from .plan import FAULTS_MAX
from .roles import CLIENTS


#: seconds of faults of ``--run`` without ``--duration``
DURATION_S_DEFAULT = 60.0
#: The number options (seconds, jobs/s) that must be finite and above 0, or finite and at
#: least 0; the probabilities are checked by :func:`shardq.verify.main` (0 to 1: nan fails).
_POSITIVE = ("fault_interval", "visibility", "health_timeout", "rate")
_NOT_NEGATIVE = ("duration", "drain_timeout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardq verify", description="chaos run + history checker")
    p.add_argument("--duration", type=float, default=None,
                   help=f"seconds of faults; a run starts only with this or --run (default {DURATION_S_DEFAULT:g} "
                        "with --run)")
    p.add_argument("--run", action="store_true",
                   help=f"start the run with the default --duration ({DURATION_S_DEFAULT:g} s); without it and "
                        "without --duration, verify only says what it would do")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--keys", type=int, default=20)
    p.add_argument("--seed", type=int, default=None,
                   help="default: random (printed); fixes the fault schedule, not the interleaving")
    p.add_argument("--data-dir", help="fresh service data dir (default: a temp dir, removed on pass)")
    p.add_argument("--json", help="write the full report to this file")
    p.add_argument("--fault-interval", type=float, default=3.0, help="mean seconds between faults")
    p.add_argument("--visibility", type=float, default=1.0, help="visibility timeout, seconds")
    p.add_argument("--health-timeout", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=100.0, help="jobs/s per producer")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--max-deliveries", type=int, default=1_000_000,
                   help="queue max_deliveries (default: out of reach; small values show what "
                        "dead-lettering does to per-key order)")
    p.add_argument("--stall-prob", type=float, default=0.002,
                   help="chance that a worker stalls past a lease's deadline (before its transaction, "
                        "inside it, or before the ack)")
    p.add_argument("--nack-prob", type=float, default=0.0,
                   help="chance that a worker fails a job (no effect) and hands it back with a nack "
                        "of 0 s or 0.05-0.5 s (a retry backoff, during which the job blocks its key)")
    p.add_argument("--extend-prob", type=float, default=0.0,
                   help="chance that a worker extends a lease by two visibility timeouts and works "
                        "past its first deadline (a long handler's heartbeat)")
    p.add_argument("--delay-prob", type=float, default=0.0,
                   help="chance that a job is enqueued with a delay of 0.05-0.5 s (it blocks the "
                        "later jobs of its key until it is done)")
    p.add_argument("--kill-producers", action="store_true",
                   help="add producer kills to the faults: SIGKILL a producer, start a new one that "
                        "takes up its history (with --dedup it first sends again the call the "
                        "killed one left without an answer, as an application's outbox would)")
    p.add_argument("--worker-kind", choices=("loop", "runner", "runner-process"), default="loop",
                   help="loop: the harness's own dequeue/commit/ack loop (default); runner: the "
                        "standard worker runner (shardq worker, --worker-batch threads) with its SQLite "
                        "idempotency store, and a handler that writes the effect in its transaction; "
                        "runner-process: the same in process mode (a pool of processes, which a "
                        "killed runner leaves to finish their jobs)")
    p.add_argument("--lease-sync", choices=("batched", "strict"), default="batched",
                   help="the queue's lease_sync (docs/guarantees.md); under strict a lease lost to a "
                        "crash (the job leased again during it, or its delivery count reused) fails the run")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on pass")
    p.add_argument("--target", help="run against this backend instead of a local service, e.g. "
                                    "sqs://<region>/<prefix>?endpoint=URL: its queue 'default' is "
                                    "created (sqs init) and must be empty; only worker faults "
                                    "(kills and stalls) are injected")
    p.add_argument("--worker-batch", type=int, default=None,
                   help="jobs per worker dequeue (default 4; 1 with --target, see docs/scale-out.md)")
    p.add_argument("--body-bytes", type=int, default=0,
                   help="pad every body to this many bytes (default: a few bytes, the bare header); "
                        "segments and the compaction threshold grow with it")
    p.add_argument("--power-cuts", action="store_true",
                   help="add power cuts to the faults: SIGKILL the service, drop or zero random "
                        "unsynced 4 KiB pages of each shard's newest segment, restart")
    p.add_argument("--client", choices=CLIENTS, default="threads",
                   help="the client of the producers and workers: the threaded router "
                        "(shardq.connect, default) or the asyncio client (shardq.aio.connect)")
    p.add_argument("--disk-faults", action="store_true",
                   help="run the disk-fault campaign instead of the chaos run: damage synced log "
                        "data (zeroed 512 B and 4 KiB blocks, flipped bits, misdirected page writes; "
                        "in segments and checkpoints) of a stopped shard between phases of work; "
                        "each acknowledged job must come back or the shard must refuse to start")
    p.add_argument("--faults-per-kind", type=int, default=6,
                   help="with --disk-faults: faults of each of the 4 kinds (default 6)")
    p.add_argument("--dedup", action="store_true",
                   help="producers give every job a dedup id (of the longest length allowed) and "
                        "send an enqueue of unknown outcome again with the same ids until it is "
                        "answered: the queue must add each job once")
    return p


def settle_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """Fill in the defaults that depend on other options or on chance (the seed), and refuse
    (UsageError naming the option, exit 2) a number option no run can use (:func:`check_numbers`)."""
    check_numbers(a)
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 2**31)
    if a.duration is None:
        a.duration = DURATION_S_DEFAULT
    if a.worker_batch is None:
        a.worker_batch = 1 if a.target else 4
    return a


def check_numbers(a: argparse.Namespace) -> None:
    """UsageError naming the option for a seconds or rate option that is not a finite number
    (``nan``, ``inf``), or is at or below 0 (``--duration``, ``--drain-timeout``: below 0); and
    for a ``--duration`` so long, for its ``--fault-interval``, that the run would plan more
    than :data:`FAULTS_MAX` faults. An interval of 0 planned faults for ever."""
    for name in _POSITIVE + _NOT_NEGATIVE:
        value = getattr(a, name, None)
        if value is None:  # --duration not given: the default
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")
        if name in _POSITIVE and value <= 0:
            raise UsageError(f"{flag} must be more than 0, got {value:g}")
        if value < 0:
            raise UsageError(f"{flag} must be 0 or more, got {value:g}")
    duration = DURATION_S_DEFAULT if a.duration is None else a.duration
    if duration / a.fault_interval > FAULTS_MAX:
        raise UsageError(f"--duration {duration:g} with --fault-interval {a.fault_interval:g} plans more than "
                         f"{FAULTS_MAX:,} faults: give a shorter --duration or a longer --fault-interval")
