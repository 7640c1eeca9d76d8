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

# Job ids as text (string ids of other backends; the PostgreSQL idempotency store's key).
JOB_ID_STR_BYTES_MAX = 1024
