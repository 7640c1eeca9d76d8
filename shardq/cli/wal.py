"""``shardq wal check [PATH]`` and ``shardq wal repair SHARD_DIR --force``: offline log tools."""
from __future__ import annotations

import argparse

import os

from ..errors import UsageError
from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("wal", help="check logs offline, or repair one shard dir")
    actions = s.add_subparsers(dest="action", required=True)
    c = actions.add_parser("check", parents=[parent],
                           help=f"validate every log file without writing, and name the ones missing "
                           f"(exit {exits.FAILURE} on corruption)")
    c.add_argument("path", nargs="?", help="a shard dir or a data dir (default: the configured data dir)")
    c.set_defaults(fn=check)
    r = actions.add_parser("repair", help="salvage one shard's log: keep every record that reads whole, around "
                           "damaged bytes or missing files, and name the jobs lost")
    r.add_argument("path", help="the shard directory, e.g. var/shardq/shard-0")
    r.add_argument("--force", action="store_true", help="change the log: drop the damaged records, or the "
                   "changes the missing files held (the originals are kept in <shard dir>/repair-<time>/)")
    r.set_defaults(fn=repair)


def _shard_dirs(path: str) -> list[str]:
    """The shard directories ``path`` names: itself, or every shard of a data dir."""
    from ..datadir import META, DataDir
    from ..wal.format import parse_name
    if not os.path.isdir(path):
        raise UsageError(f"{path}: {'not a directory' if os.path.lexists(path) else 'no such directory'}")
    if os.path.exists(os.path.join(path, META)):
        dd = DataDir(path)
        return [dd.shard_dir(i) for i in range(dd.shards())]
    if not any(parse_name(n) for n in os.listdir(path)):
        raise UsageError(f"{path} is neither a shardq data dir nor a shard directory (no log files in it)")
    return [path]


def check(args: argparse.Namespace) -> int:
    from ..wal import repair as wal_repair
    bad = 0
    for d in _shard_dirs(args.path or common.local_service_dir(args, "wal check")):
        if not os.path.isdir(d):
            print(f"{'missing':<8}{d}")
            continue
        for r in wal_repair.check(d):
            extra = f" at offset {r.offset}: {r.reason}" if r.status != "ok" else ""
            print(f"{r.status:<8}{r.path} records={r.records}{extra}")
            bad += r.status == "corrupt"
    return exits.FAILURE if bad else exits.OK


def repair(args: argparse.Namespace) -> int:
    from ..wal import repair as wal_repair
    if not os.path.isdir(args.path):
        raise UsageError(f"{args.path}: no such directory")
    try:
        if wal_repair.salvage_wanted(wal_repair.check(args.path)):
            if not args.force:
                raise PermissionError("repair changes the log: it drops the damaged records and keeps every "
                                      "record that reads whole; pass --force")
            from ..shard.salvage import salvage
            done = salvage(args.path)
        else:
            done = wal_repair.repair(args.path, force=args.force)
    except PermissionError as e:  # refused without --force: nothing was changed
        raise UsageError(str(e)) from None
    for line in done:
        print(line)
    return exits.OK
