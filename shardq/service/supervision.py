"""The supervisor's decisions, apart from its processes and pipes (:mod:`.supervisor`)."""
from __future__ import annotations

import signal

START_TIMEOUT_S = 60.0          # a starting shard that reports nothing for this long is hung
RESTART_BACKOFF_S_FIRST = 0.5   # the delay before the second restart in a row; doubles after
STABLE_RUN_S = 10.0             # ready this long (or restart_backoff_max if less): failures reset
EXIT_LOG_FAILED = 4             # shardq.shard.process's exit code for a failed log write


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal={signal.Signals(-code).name}"
        except ValueError:
            return f"signal={-code}"
    return f"code={code}"
