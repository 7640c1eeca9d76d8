"""``shardq verify``: a seeded chaos run against a real service, then a history checker.

The run (Jepsen's ``total-queue`` workload, with kills and pauses):

* a real ``shardq serve`` on a fresh data dir: 1 s visibility timeout, a short health
  timeout, small WAL segments so compaction runs during the test;
* producer processes enqueue jobs under known keys; a job's body is ``"<producer> <key>
  <seq>"`` with a per-key sequence number (each key belongs to one producer, so its seqs are
  in enqueue order), padded to ``--body-bytes`` with bytes derived from that header. Every
  enqueue's invocation and outcome (ok + ids / error) is appended and flushed to the
  producer's history file before and after the call;
* idempotent worker processes: for each lease, one SQLite transaction (WAL, synchronous=FULL,
  ``BEGIN IMMEDIATE``) inserts the effect row (the body's header and a digest of the whole
  body) unless its job id is already there; commit; then ack. Workers log every lease (job
  id, key, attempt, token, deadline, times of lease, commit and ack) to their own history
  files;
* a fault schedule drawn from the seed before the run (:mod:`.plan`; the seed fixes the
  faults, not the interleaving of the processes, so the counts differ between two runs of
  one seed): SIGKILL one shard, SIGKILL the whole supervisor and its shards (then restart
  the service on the same data dir), SIGKILL a worker (restarted), SIGSTOP a shard or a
  worker for longer than the visibility timeout (sometimes longer than the health timeout,
  so the supervisor kills the shard as hung); with ``--power-cuts`` also a power cut
  (SIGKILL the service, lose random unsynced 4 KiB pages of each shard's newest segment:
  :mod:`.powercut`, then restart). Each round holds each kind once, in seeded order, and a
  run has at least one round;
* then faults stop, producers stop, workers drain the queue, and :func:`check` reads the
  histories and the effect table.

``--disk-faults`` runs another campaign instead (:mod:`.diskcampaign`): phases of work on
a real service, each followed by one fault of data that was synced before it (a zeroed
sector or page, a flipped bit, a misdirected page write; in segments and checkpoints:
:mod:`.diskfaults`), and a verdict per fault: every acknowledged job kept, or the shard
refused with the damaged file and offset; anything else is a loss and fails the run.

``--target sqs://...`` runs the same producers, workers and checker against another backend
(see :mod:`.target`): no service of ours to kill, so only worker kills and pauses.
``--client aio`` runs the producers and workers on the asyncio client (``shardq.aio``)
instead of the threaded router, so its reconnects and re-sends meet the same faults.

Pass = no lost job, no duplicated effect, no per-key order violation, no unexpected job, no
id mismatch, no double in-flight lease of a key, no reused lease token, no body delivered
other than the one enqueued (byte for byte, by digest). Exit 0 on pass, 1 on
fail, 2 when the run itself could not be carried out.

Per-key order. A key's next job becomes leasable only when its head is acked (or
dead-lettered); a worker acks only once the head's effect is committed (by itself or by an
earlier delivery); so effect(n) commits before ack(n) < lease(n+1) < effect(n+1). A worker
paused past its lease deadline may still commit late, but then nobody has acked job n yet (the
redelivery would have found and reused its row), so its late commit still precedes n+1.
Order can break only when the key is unblocked without the effect: a job dead-lettered
after ``max_deliveries`` (the run sets it out of reach and counts dead letters as lost), a
redrive, or a handler whose side effect is not inside the transaction that records the job
id. The checker counts late commits (after the lease deadline) so a run shows how often the
paused-worker case actually happened.
"""
from __future__ import annotations

import argparse
import sys

from .. import limits
from ..errors import UsageError

from .check import Report, check
from .history import (Effect, Enqueue, LeaseRec, body_digest, body_for, parse_body, read_effects,
                      read_producer_history, read_worker_history)
from .plan import Fault, fingerprint, plan
from .options import DURATION_S_DEFAULT, build_parser, settle_defaults
from .roles import CLIENTS, producer_main, worker_main
from .run import run

__all__ = ["main", "run", "check", "Report", "Effect", "Enqueue", "LeaseRec", "body_for", "body_digest",
           "parse_body", "read_effects", "read_producer_history", "read_worker_history", "producer_main",
           "worker_main", "plan", "Fault", "fingerprint"]


def _child_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"shardq verify {role}")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--retry-s", type=float, default=5.0)
    p.add_argument("--client", choices=CLIENTS, default="threads")
    if role == "_producer":
        p.add_argument("--index", type=int, required=True)
        p.add_argument("--keys", required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--rate", type=float, required=True)
        p.add_argument("--body-bytes", type=int, default=0)
        p.add_argument("--dedup", action="store_true")
        p.add_argument("--delay-prob", type=float, default=0.0)
        p.add_argument("--resume", action="store_true")
    else:
        p.add_argument("--name", required=True)
        p.add_argument("--db", required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--stall-prob", type=float, default=0.0)
        p.add_argument("--stall-s", type=float, default=0.5)
        p.add_argument("--nack-prob", type=float, default=0.0)
        p.add_argument("--extend-prob", type=float, default=0.0)
        p.add_argument("--extend-s", type=float, default=2.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("_producer", "_worker"):
        role = argv[0]
        a = _child_parser(role).parse_args(argv[1:])
        return producer_main(a) if role == "_producer" else worker_main(a)
    a = build_parser().parse_args(argv)
    asked = a.duration is not None or a.run  # a run starts only when asked (bare: says what it would do)
    try:
        a = settle_defaults(a)
    except UsageError as e:  # (shardq verify and python -m shardq.verify alike: one line, exit 2)
        print(f"error: UsageError: {e}", file=sys.stderr)
        return 2
    if a.disk_faults:
        return _disk_faults(a)
    if a.keys < a.producers or min(a.shards, a.producers, a.workers, a.keys) < 1:
        print("error: need at least one shard, producer, worker and key, and keys >= producers", file=sys.stderr)
        return 2
    if not 0 <= a.body_bytes <= limits.BODY_BYTES_MAX_CEILING:
        print(f"error: --body-bytes must be 0 to {limits.BODY_BYTES_MAX_CEILING}", file=sys.stderr)
        return 2
    for name in ("stall_prob", "nack_prob", "extend_prob", "delay_prob"):
        if not 0.0 <= getattr(a, name) <= 1.0:
            print(f"error: --{name.replace('_', '-')} must be a probability, 0 to 1", file=sys.stderr)
            return 2
    if a.delay_prob and a.target:
        print("error: --delay-prob needs the local service (SQS FIFO queues have no per-job delay)",
              file=sys.stderr)
        return 2
    if a.worker_kind == "runner-process" and a.extend_prob:
        print("error: --extend-prob needs the runner's thread mode (ctx.extend is not available "
              "in process mode)", file=sys.stderr)
        return 2
    if a.lease_sync != "batched" and a.target:
        print("error: --lease-sync is a setting of the local service (not --target)", file=sys.stderr)
        return 2
    if a.power_cuts and a.target:
        print("error: --power-cuts needs the local service (not --target)", file=sys.stderr)
        return 2
    if a.client == "aio" and a.target:
        print("error: --client aio needs the local service (the asyncio client has no SQS backend)",
              file=sys.stderr)
        return 2
    if not asked:
        print(what_it_would_do(a))
        return 2
    return run(a)


def what_it_would_do(a: argparse.Namespace) -> str:
    """What a bare ``shardq verify`` prints instead of starting a run: a run starts a
    service and kills its processes for a minute, which nobody should get by accident."""
    where = a.target or f"a real shardq service of {a.shards} shards in " + (a.data_dir or "a new temp dir under /tmp")
    return (f"shardq verify would start a chaos run for {DURATION_S_DEFAULT:g} s against {where}: {a.producers} "
            f"producers and {a.workers} workers, their processes (and the service's) killed and paused every "
            f"{a.fault_interval:g} s or so, then every job checked (none lost, duplicated, reordered or "
            "altered). Its temp dir is removed when it ends, however it ends, unless --keep or a FAIL verdict "
            "keeps it.\n"
            f"Nothing was run: give --duration SECONDS, or --run for {DURATION_S_DEFAULT:g} s, to start it "
            "(--disk-faults runs the disk-fault campaign instead; --help lists every option).")


def _disk_faults(a: argparse.Namespace) -> int:
    if a.target or a.power_cuts:
        print("error: --disk-faults is a campaign of its own, on the local service (not with --target "
              "or --power-cuts)", file=sys.stderr)
        return 2
    if a.shards < 2 or a.faults_per_kind < 1:
        print("error: --disk-faults needs at least 2 shards (the undamaged ones must keep serving) and "
              "--faults-per-kind of at least 1", file=sys.stderr)
        return 2
    from .diskcampaign import run_campaign
    return run_campaign(a)
