"""Log operations: what a shard writes to its WAL and replays.

Each WAL record is a msgpack list of operations; each operation is a list whose first item
is one of the codes below. The live path applies exactly the operations it logs, through the
same functions replay uses, so replay rebuilds the same state by construction.

Lease expiry and the moment a delayed job becomes due are *not* logged: both follow from
the stored deadlines and the clock, so replay re-derives them.
"""
from __future__ import annotations

ENQUEUE = 1   # [1, job_id, queue, key, body, priority, ready_at, dedup_id, created_at, dedup_expires]
              # dedup_expires (only with a dedup_id): when the id is forgotten, so a later change of
              # dedup_window moves nothing (older records lack it: today's window stands in)
LEASE = 2     # [2, job_id, token, expires_at]            attempts += 1
ACK = 3       # [3, job_id]                               job deleted
RELEASE = 4   # [4, job_id, ready_at, error(, undelivered)] nack: ready now (0) or at ready_at;
              # undelivered=True: the lease never reached a handler, attempts -= 1
EXTEND = 5    # [5, job_id, expires_at]
DEAD = 6      # [6, job_id, error]                        moved to the dead-letter queue
REDRIVE = 7   # [7, job_id]                               back to the tail of its key, attempts 0
SESSION = 8   # [8, client_id, client_seq, client_low, [job_ids], at]   router retry record
PURGE = 9     # [9, job_id]                               dead letter deleted
EPOCH = 10    # [10, epoch]    every lease token from here on is >= epoch << TOKEN_EPOCH_BITS
              # (logged and fsynced at each shard start: no token is ever handed out twice)
PRIORITIES = 11  # [11, queue]  the queue uses priorities (sticky): routers compare shards
                 # (queue-wide priorities). Also written by checkpoints.

# Control operations (shardq/shard/control.py). Also written by checkpoints: a paused queue
# as its PAUSE, a cancelled lease as a CANCEL after its JOB.
PAUSE = 30    # [30, queue, paused_at | None]             None: resumed
CANCEL = 31   # [31, job_id]  a leased job not yet marked: marked cancelled; else: deleted

# Checkpoint-only operations (a checkpoint is the live state written as operations).
META = 20     # [20, next_seq, next_token(, epoch)]
JOB = 21      # [21, job_id, queue, key, body, priority, ready_at, attempts, state, token, expires_at, error]
DEDUP = 22    # [22, queue, key, dedup_id, job_id, expires_at]
CLIENT = 23   # [23, client_id, last_seen, [[client_seq, [job_ids]], ...]]
ENQUEUE_TIMES = 40  # [40, [seq, ...], [time, ...]]      sampled enqueue times (enqueue_times.py)

#: Lease tokens are (epoch << TOKEN_EPOCH_BITS) + a counter within the epoch.
TOKEN_EPOCH_BITS = 32

NAMES = {EPOCH: "epoch", ENQUEUE: "enqueue", LEASE: "lease", ACK: "ack", RELEASE: "release", EXTEND: "extend",
         DEAD: "dead", REDRIVE: "redrive", SESSION: "session", PURGE: "purge", META: "meta",
         JOB: "job", DEDUP: "dedup", CLIENT: "client", PAUSE: "pause", CANCEL: "cancel",
         ENQUEUE_TIMES: "enqueue_times", PRIORITIES: "priorities"}
