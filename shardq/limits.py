"""Every limit in one place, with units in the names.

These are defaults; the ones marked *configurable* can be changed per queue or per service
in the TOML config (see :mod:`shardq.config`).
"""
from __future__ import annotations

# Jobs (configurable per queue: max_body_bytes).
BODY_BYTES_MAX_DEFAULT = 256 * 1024
BODY_BYTES_MAX_CEILING = 16 * 1024 * 1024
KEY_BYTES_MAX = 512
QUEUE_NAME_BYTES_MAX = 128
DEDUP_ID_BYTES_MAX = 128
ERROR_TEXT_BYTES_MAX = 2048
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1
DELAY_S_MAX = 365 * 24 * 3600.0

# Queue settings (configurable per queue).
VISIBILITY_TIMEOUT_S_DEFAULT = 30.0
VISIBILITY_TIMEOUT_S_MAX = 12 * 3600.0
MAX_DELIVERIES_DEFAULT = 5
DEDUP_WINDOW_S_DEFAULT = 300.0

# Requests.
BATCH_JOBS_MAX = 10_000
FRAME_BYTES_MAX = 64 * 1024 * 1024
WAIT_S_MAX = 60.0

# Per shard (configurable in [limits]).
PENDING_JOBS_MAX_DEFAULT = 5_000_000  # backpressure: QueueFull past this many jobs
CLIENT_SESSIONS_MAX = 100_000
CLIENT_SESSION_TTL_S = 600.0

# Write-ahead log (configurable in [limits]).
SEGMENT_BYTES_MAX_DEFAULT = 64 * 1024 * 1024
RECORD_BYTES_MAX = FRAME_BYTES_MAX + 1024 * 1024
COMPACT_MIN_BYTES_DEFAULT = 64 * 1024 * 1024  # never compact a log smaller than this

# Shards.
SHARDS_MAX = 1024
JOB_ID_SHARD_BITS = 10  # job_id = (sequence << 10) | shard_index

# Amazon SQS FIFO (the sqs backend; fixed by the service, not configurable).
SQS_MESSAGE_BYTES_MAX = 1024 * 1024      # body + message attributes, as SQS counts them
SQS_MESSAGE_BYTES_MIN = 1024             # lowest MaximumMessageSize a queue may have
SQS_BATCH_ENTRIES_MAX = 10
SQS_BATCH_BYTES_MAX = 1024 * 1024        # a SendMessageBatch, all entries together
SQS_WAIT_S_MAX = 20                      # ReceiveMessage WaitTimeSeconds (whole seconds)
SQS_VISIBILITY_S_MAX = 12 * 3600         # per receive, extensions included (whole seconds)
SQS_MAX_RECEIVE_COUNT_MAX = 1000         # RedrivePolicy maxReceiveCount
SQS_DEDUP_WINDOW_S = 300.0               # MessageDeduplicationId window, fixed
SQS_RETENTION_S_MAX = 14 * 24 * 3600
SQS_QUEUE_NAME_CHARS_MAX = 80            # ".fifo" included
SQS_GROUP_ID_CHARS_MAX = 128
SQS_DEDUP_ID_CHARS_MAX = 128
