"""The ``shardq`` command.

    shardq serve [--config config/shardq.toml] [--data-dir D] [--shards N]
    shardq console
    shardq enqueue BODY [--key K] [--queue Q] [--delay S] [--priority P] [--dedup-id ID]
    shardq dequeue [--queue Q] [--wait S] [--visibility S] [--max N]
    shardq ack JOB_ID TOKEN | shardq nack JOB_ID TOKEN [--delay S] [--error TEXT]
    shardq stats [--json]
    shardq dead-letters list|redrive|purge [--queue Q] [--limit N] [--cursor C] [--id ID ...]
    shardq queue pause|resume|limit NAME [--create] [--concurrency N] [...]
    shardq job [show] ID | shardq job cancel ID
    shardq wal check [PATH] | shardq wal repair SHARD_DIR --force
    shardq worker module:function [--queue Q] [--concurrency N] [...]
    shardq worker myapp.tasks [more.modules] [--queue Q ...] [...]
    shardq schedules [--json]
    shardq outbox init|relay|status --dsn DSN [--table T]
    shardq verify --duration S | --run [--target sqs://...] [...]   (bare: says what it would do)
    shardq --version
    shardq sqs init [--config F] --connect sqs://<region>/<prefix>

Every command that talks to the service finds it by ``--data-dir`` (alias ``--connect``),
default: the config's ``service.data_dir``. Each command group is one module of this
package with a ``register(subparsers, parent)`` function, listed in :data:`GROUPS`.
Errors print one line ``error: <Type>: <message>`` on stderr, never a traceback, and exit
with the code of :mod:`.exits`.
"""
from __future__ import annotations

import argparse
import logging
import sys

from . import (backup, common, console, dead_letters, exits, job_control, jobs, outbox, queue_control,
               schedules, serve, sqs, stats, verify, wal, worker, workflow)
from .common import Parser, run_guarded

GROUPS = (serve, console, jobs, stats, dead_letters, wal, backup, worker, verify, schedules, queue_control,
          job_control, workflow, outbox, sqs)


def version() -> str:
    """The installed package's version (pyproject.toml's, as pip installed it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("shardq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``: prints ``shardq <version>`` and exits, the version read only then
    (``importlib.metadata`` costs every other command ~10 ms of start-up)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"shardq {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="shardq", description="durable sharded job queue")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    parent = common.common_parser()
    for group in GROUPS:
        group.register(sub, parent)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    if not argv:
        # Bare `shardq`: the help, on stdout, exit 0 (as `pip`, `docker`, `cargo` do), not
        # argparse's "the following arguments are required" (docs/operations.md, "CLI").
        parser.print_help()
        return exits.OK
    if argv[0] == "verify":
        args, rest = parser.parse_args(argv[:1]), argv[1:]
        return run_guarded(lambda: args.fn(args, rest))
    args = parser.parse_args(argv)
    return run_guarded(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
