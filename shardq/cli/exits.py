"""The exit codes of every ``shardq`` command, defined once.

docs/operations.md ("Exit codes") shows this table; a test keeps the two identical.
"""
from __future__ import annotations

from ..errors import (AuthError, CorruptLog, InvalidConfig, InvalidJob, LeaseLost, LogFailed,
                      NotFound, ProtocolError, QueueFull, ShardqError, ShardUnavailable, Unsupported,
                      UsageError)

OK = 0
FAILURE = 1     # the service or the disk failed: no service, a shard down, a log write failed, a corrupt log, QueueFull
USAGE = 2       # the command line or the job was wrong: bad arguments, InvalidJob, NotFound (no such job), Unsupported
EMPTY = 3       # nothing to do: dequeue found no job
LEASE_LOST = 4  # ack/nack/extend with a lease that is no longer current (LeaseLost, Cancelled)
SETUP = 5       # the setup is wrong: config file, not a data dir, lock held, read-only, shard count, key file

#: (code, meaning) for the documentation table.
TABLE = [
    (OK, "success"),
    (FAILURE, "the service or the disk failed: no service runs on the data dir (`ServiceNotRunning`), "
              "a shard is down or did not answer, a log write failed, `wal check` found corruption, "
              "`QueueFull`"),
    (USAGE, "usage or input error: bad arguments, an invalid job (`InvalidJob`, `UnknownQueue`), "
            "a job id that does not exist (`NotFound: no such job`, the same from every command that "
            "takes one), a feature the backend cannot provide (`Unsupported`: nothing was changed)"),
    (EMPTY, "nothing to dequeue"),
    (LEASE_LOST, "the lease is no longer current (`LeaseLost`, `Cancelled`): nothing was changed"),
    (SETUP, "setup error: bad config file, not a data dir, data dir held by another process "
            "(`DataDirLocked` names its PID) or not writable (`DataDirNotWritable`), shard count "
            "mismatch, unsafe key file or socket directory"),
]


def for_error(exc: BaseException) -> int:
    """The exit code for an error that ended a command."""
    if isinstance(exc, LeaseLost):
        return LEASE_LOST
    if isinstance(exc, (InvalidConfig, AuthError)):
        return SETUP
    if isinstance(exc, (InvalidJob, NotFound, ProtocolError, UsageError, Unsupported)):
        return USAGE
    if isinstance(exc, (ShardUnavailable, LogFailed, CorruptLog, QueueFull, ShardqError, OSError)):
        return FAILURE
    return FAILURE
