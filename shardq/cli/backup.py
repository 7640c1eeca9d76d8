"""``shardq backup DEST`` and ``shardq restore BACKUP --data-dir NEW`` (docs/backup.md)."""
from __future__ import annotations

import argparse

import datetime
import os

from ..clock import Clock, SystemClock
from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    b = sub.add_parser("backup", parents=[parent],
                       help="copy every shard of the running service into DEST, consistently, while it serves",
                       description="Take a cut of every shard of the service running on --data-dir and copy its "
                                   "log up to the cut, with the key file, into DEST (docs/backup.md).")
    b.add_argument("dest", help="a new or empty directory (created mode 0700): the copy holds job bodies and the key")
    b.set_defaults(fn=run_backup)
    r = sub.add_parser("restore", parents=[parent],
                       help="check a backup (every record, every file's hash, the key file) and write it as "
                            "a new data dir (--data-dir) that serve starts on",
                       description="Check every file of a backup, then write it as the data dir --data-dir "
                                   "(default: the config's service.data_dir), which must be new or empty; "
                                   "it is left untouched unless every check passes.")
    r.add_argument("backup", help="the directory shardq backup wrote")
    r.set_defaults(fn=run_restore)


def when(t: float) -> str:
    """A shard's clock reading, as the cut lines print it (UTC, microseconds)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def run_backup(args: argparse.Namespace, clock: Clock | None = None) -> int:
    from ..backup.take import backup
    clock = clock or SystemClock()
    t0 = clock.monotonic()
    m = backup(common.local_service_dir(args, "backup"), args.dest, clock)
    seconds = clock.monotonic() - t0
    dest = os.path.abspath(args.dest)
    for c in m.cuts:
        print(f"shard {c.shard}: cut at {when(c.time)}: {c.segment} up to byte {c.offset} (write {c.write}, "
              f"jobs numbered up to {c.job_seq}); {files(len(c.files))}, {mib(c.total_bytes)}")
    print(f"backup of {m.shards} shards in {dest}: {mib(m.total_bytes)} in {seconds:.2f} s; "
          f"restore it with: shardq restore {dest} --data-dir NEW")
    return exits.OK


def run_restore(args: argparse.Namespace) -> int:
    from ..backup.restore import restore
    dest = common.local_only(common.target(args), "restore")
    if os.path.lexists(args.backup) and not os.path.isdir(args.backup):
        from ..errors import UsageError
        raise UsageError(f"{args.backup} is not a shardq backup: a backup is the directory `shardq backup` "
                         "wrote, not a file")
    r = restore(args.backup, dest)
    for s in r.shards:
        print(f"shard {s.cut.shard}: {files(len(s.cut.files))}, {s.records} records verified; "
              f"{s.jobs} jobs as of the cut at {when(s.cut.time)}")
    serve = r.serve_command(args.config and os.path.abspath(args.config))
    print(f"restored {r.manifest.shards} shards into {r.path} (service id {r.service_id}, restored from "
          f"{r.manifest.service_id}); check it beside the running service with: {serve}")
    return exits.OK
