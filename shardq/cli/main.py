"""The ``shardq`` command.

    shardq serve [--config config/shardq.toml] [--data-dir D] [--shards N]
    shardq enqueue BODY [--key K] [--queue Q] [--delay S] [--priority P] [--dedup-id ID]
    shardq dequeue [--queue Q] [--wait S] [--visibility S] [--max N]
    shardq ack JOB_ID TOKEN | shardq nack JOB_ID TOKEN [--delay S] [--error TEXT]
    shardq stats [--json]
    shardq dead-letters list|redrive|purge [--queue Q]
    shardq wal check [--data-dir D] | shardq wal repair SHARD_DIR --force
    shardq worker module:function [--queue Q] [--concurrency N] [...]
    shardq verify [--duration S] [...]

Client commands find the service by ``--data-dir`` (default: the config's data_dir).
Errors print one line ``error: <Type>: <message>`` and exit 2 (bad input) or 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .. import config as config_mod
from ..errors import InvalidConfig, InvalidJob, ShardqError

DEFAULT_CONFIG = "config/shardq.toml"


def _load_config(path: str | None):
    if path is None:
        return config_mod.load(DEFAULT_CONFIG) if os.path.exists(DEFAULT_CONFIG) else config_mod.Config()
    return config_mod.load(path)


def _data_dir(args) -> str:
    return args.data_dir or _load_config(args.config).service.data_dir


def _router(args):
    from ..client.router import Router
    return Router(_data_dir(args))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def cmd_serve(args) -> int:
    from ..service.supervisor import Supervisor
    cfg = _load_config(args.config)
    sup = Supervisor(args.data_dir or cfg.service.data_dir, cfg, args.shards)
    sup.start()
    print(f"shardq serving {sup.dd.path} with {len(sup.handles)} shards; sockets in {sup.dd.run_dir}",
          file=sys.stderr, flush=True)
    return sup.run()


def cmd_enqueue(args) -> int:
    with _router(args) as q:
        body = args.body.encode() if args.body != "-" else sys.stdin.buffer.read()
        print(q.enqueue(body, key=args.key, queue=args.queue, delay=args.delay, priority=args.priority,
                        dedup_id=args.dedup_id))
    return 0


def cmd_dequeue(args) -> int:
    with _router(args) as q:
        leases = q.dequeue_many(args.queue, max_jobs=args.max, wait=args.wait, visibility=args.visibility)
        for l in leases:
            print(json.dumps({"job_id": l.job_id, "token": l.token, "key": l.key, "attempt": l.attempt,
                              "deadline": l.deadline, "body": l.body.decode("utf-8", "replace")}))
    return 0 if leases else 3


def _lease(args):
    from ..types import Lease
    return Lease(args.job_id, None, b"", args.queue, 0, args.token, 0.0)


def cmd_ack(args) -> int:
    with _router(args) as q:
        q.ack(_lease(args))
    return 0


def cmd_nack(args) -> int:
    with _router(args) as q:
        q.nack(_lease(args), delay=args.delay, error=args.error)
    return 0


def cmd_stats(args) -> int:
    with _router(args) as q:
        st = q.stats()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    cols = ["ready", "delayed", "waiting", "in_flight", "dead", "keys"]
    print(f"{'queue':<20}" + "".join(f"{c:>11}" for c in cols))
    for name, c in sorted(st["queues"].items()):
        print(f"{name:<20}" + "".join(f"{c.get(k, 0):>11}" for k in cols))
    print()
    print(f"{'shard':<6}{'pid':>8}{'jobs':>11}{'wal_bytes':>13}{'segments':>10}{'clients':>9}")
    for sh in st["shards"]:
        if not sh.get("available"):
            print(f"{sh['shard']:<6}{'DOWN':>8}  {sh.get('error', '')}")
            continue
        print(f"{sh['shard']:<6}{sh['pid']:>8}{sh['jobs']:>11}{sh['wal_bytes']:>13}{sh['segments']:>10}"
              f"{sh['clients']:>9}")
    return 0


def cmd_dead_letters(args) -> int:
    with _router(args) as q:
        if args.action == "list":
            for d in q.dead_letters(args.queue, limit=args.limit):
                print(json.dumps({"job_id": d.job_id, "key": d.key, "attempts": d.attempts, "error": d.error,
                                  "body": d.body.decode("utf-8", "replace")}))
        elif args.action == "redrive":
            print(f"redriven: {q.redrive(args.queue)}")
        else:
            print(f"purged: {q.purge_dead_letters(args.queue)}")
    return 0


def cmd_wal(args) -> int:
    from ..datadir import DataDir
    from ..wal import repair as wal_repair
    if args.action == "repair":
        if not args.path:
            raise InvalidJob("wal repair needs the shard directory, e.g. var/shardq/shard-0")
        for line in wal_repair.repair(args.path, force=args.force):
            print(line)
        return 0
    if args.path:
        dirs = [args.path]
    else:
        dd = DataDir(_data_dir(args))
        dirs = [dd.shard_dir(i) for i in range(dd.shards())]
    bad = 0
    for d in dirs:
        for r in wal_repair.check(d):
            extra = f" at offset {r.offset}: {r.reason}" if r.status != "ok" else ""
            print(f"{r.status:<8}{r.path} records={r.records}{extra}")
            bad += r.status == "corrupt"
    return 1 if bad else 0


def cmd_worker(args, rest: list[str]) -> int:
    from . import worker as worker_cli
    return worker_cli.main(rest)


def cmd_verify(args, rest: list[str]) -> int:
    from .. import verify
    return verify.main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardq", description="durable sharded job queue")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG} if present)")
    common.add_argument("--data-dir", help="service data dir (default: the config's)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", parents=[common], help="run the shard supervisor (the service)")
    s.add_argument("--shards", type=int, help="number of shards (default: config; 0 = CPUs)")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("enqueue", parents=[common], help="enqueue one job; prints its id")
    s.add_argument("body", help="job body (UTF-8 text), or - to read bytes from stdin")
    s.add_argument("--key")
    s.add_argument("--queue", default="default")
    s.add_argument("--delay", type=_number, default=0.0)
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--dedup-id")
    s.set_defaults(fn=cmd_enqueue)

    s = sub.add_parser("dequeue", parents=[common], help="lease jobs; prints one JSON line per lease")
    s.add_argument("--queue", default="default")
    s.add_argument("--wait", type=_number, default=0.0)
    s.add_argument("--visibility", type=_number)
    s.add_argument("--max", type=int, default=1)
    s.set_defaults(fn=cmd_dequeue)

    for name, fn in (("ack", cmd_ack), ("nack", cmd_nack)):
        s = sub.add_parser(name, parents=[common], help=f"{name} a lease")
        s.add_argument("job_id", type=int)
        s.add_argument("token", type=int)
        s.add_argument("--queue", default="default")
        if name == "nack":
            s.add_argument("--delay", type=_number, default=0.0)
            s.add_argument("--error")
        s.set_defaults(fn=fn)

    s = sub.add_parser("stats", parents=[common], help="per-queue and per-shard figures")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_stats)

    s = sub.add_parser("dead-letters", parents=[common], help="list, redrive or purge dead letters")
    s.add_argument("action", choices=["list", "redrive", "purge"])
    s.add_argument("--queue", default="default")
    s.add_argument("--limit", type=int, default=100)
    s.set_defaults(fn=cmd_dead_letters)

    s = sub.add_parser("wal", parents=[common], help="check logs offline, or repair one shard dir")
    s.add_argument("action", choices=["check", "repair"])
    s.add_argument("path", nargs="?", help="a shard directory (default: every shard of the data dir)")
    s.add_argument("--force", action="store_true", help="repair: drop everything from the bad record on")
    s.set_defaults(fn=cmd_wal)

    s = sub.add_parser("worker", help="run a worker: shardq worker module:function [options]", add_help=False)
    s.set_defaults(fn=cmd_worker, passthrough=True)
    s = sub.add_parser("verify", help="chaos run + history checker", add_help=False)
    s.set_defaults(fn=cmd_verify, passthrough=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    if argv and argv[0] in ("worker", "verify"):
        args, rest = parser.parse_args(argv[:1]), argv[1:]
    else:
        args, rest = parser.parse_args(argv), None
    try:
        if getattr(args, "passthrough", False):
            return args.fn(args, rest)
        return args.fn(args)
    except (InvalidJob, InvalidConfig) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except ShardqError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except PermissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
