"""Job states and the transitions allowed between them, defined once.

Every part of the state machine (:mod:`.state` and the modules its class is made of) and
:mod:`.control` imports them from here; nothing else defines a state number. The values
are logged (a checkpoint's JOB operation carries a job's state), so they never change.
"""
from __future__ import annotations

from enum import IntEnum


class JobState(IntEnum):
    WAITING = 0   # behind the head of its key
    DELAYED = 1   # head (or keyless), not due yet
    READY = 2     # can be leased
    LEASED = 3    # delivered; deadline in ``ShardState.inflight``
    DEAD = 4      # in the dead-letter queue
    GONE = 5      # acked, purged or cancelled; only stale heap/deque references see it


#: The short names the state machine's hot paths use (``job.state is R``).
W, D, R, L, X, G = (JobState.WAITING, JobState.DELAYED, JobState.READY, JobState.LEASED,
                    JobState.DEAD, JobState.GONE)
#: The state of a job not yet placed (``Job.state`` before its first transition).
NEW = None

#: Every allowed state change, checked in one place (``ShardState._set``). Some exist only
#: in replay: a lease expiry or a delay coming due is not logged, so a replayed LEASE can
#: find the job LEASED (expired) or DELAYED (due).
TRANSITIONS = frozenset({
    (NEW, W), (NEW, D), (NEW, R), (NEW, L), (NEW, X),
    (W, D), (W, R),
    (D, R), (D, L), (D, X),
    (R, L), (R, X),
    (L, L), (L, R), (L, D), (L, X), (L, G),
    (X, W), (X, D), (X, R), (X, G),
    (W, G), (D, G), (R, G),  # cancelled (control.py); R, D: also acked with the token of
                             # a lease that ran out (leases.py; D only from a checkpoint's replay)
})

#: The states a new job may enter.
FROM_NEW = frozenset(new for old, new in TRANSITIONS if old is NEW)

#: How a state is named in ``job_info`` replies (the console and ``shardq job`` show it).
STATE_NAMES = ("waiting", "delayed", "ready", "leased", "dead", "gone")
