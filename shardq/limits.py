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

# Exact limits of a queue (configurable per queue: concurrency, rate, burst, group_*;
# docs/limits.md). Bounds on the values a config or `shardq queue limit` may set.
CONCURRENCY_MAX = 1_000_000              # concurrency, group_concurrency: leases in flight
RATE_PER_S_MAX = 1_000_000.0             # rate, group_rate, once converted to per second
RATE_PER_S_MIN = 1.0 / (24 * 3600)       # the slowest rate: one lease a day
BURST_MAX = 1_000_000.0                  # tokens a bucket may hold
GROUP_SEPARATOR_CHARS_MAX = 16
#: A token bucket this close below a whole token holds it (float drift of the refill).
TOKEN_EPSILON = 1e-9

# Requests and replies. A frame (one send_bytes) holds many requests or replies; whoever
# writes frames cuts them at this size, and a reader refuses anything larger.
BATCH_JOBS_MAX = 10_000
FRAME_BYTES_MAX = 64 * 1024 * 1024
#: Requests in one frame: a shard refuses a frame announcing more before decoding it (a
#: frame of 64 MiB of tiny requests took seconds to decode); connections cut there too.
FRAME_REQUESTS_MAX = 10_000
WAIT_S_MAX = 60.0
#: Waiting dequeues and watches one connection may have parked in a shard at once (a frame's
#: worth): past it a wait is refused with QueueFull. Each is scanned by every loop iteration
#: while parked, and a connection asks again after a reply; an asyncio client shares one
#: connection a shard between all its coroutines.
PARKED_WAITS_MAX = 10_000
#: What one job's ids, numbers and msgpack headers take at most in a frame or a log record.
#: Writers bound a job's encoding by this plus its body plus 4 bytes per character of its
#: strings (UTF-8's most) to cut frames and records before encoding, so a cut is never late.
JOB_FIXED_BYTES_MAX = 96
#: What the jobs of one reply (leases, dead letters) may take, bodies and overhead counted:
#: room is left for the rest of the frame. A reply always holds at least one job (a body is
#: at most BODY_BYTES_MAX_CEILING, far below this).
REPLY_BYTES_MAX = FRAME_BYTES_MAX - 1024 * 1024
#: What the jobs of one request (a batch enqueue) may take, measured like a reply's: a
#: router cuts batches here, a shard refuses a larger one before it changes anything.
REQUEST_BYTES_MAX = FRAME_BYTES_MAX - 1024 * 1024

# Results and workflows (docs/workflows.md, docs/design.md "Workflows and results").
#: A task's return value, msgpack-encoded: a larger one fails its job with InvalidJob's text.
RESULT_BYTES_MAX = 1024 * 1024
#: How long a result (and a finished barrier) may be kept: ``keep_result`` at most this.
KEEP_RESULT_S_MAX = 90 * 24 * 3600.0
#: Results kept for a workflow's jobs whose task does not say ``keep_result``.
WORKFLOW_RESULT_S_DEFAULT = 24 * 3600.0
#: A fired or cancelled barrier is kept at least this long (the idempotency store's
#: retention): a member delivered again late still finds it and is not counted twice.
BARRIER_TOMBSTONE_S = 7 * 24 * 3600.0
#: Members of one barrier (a chord's group): the arrivals a shard counts for it.
BARRIER_MEMBERS_MAX = 100_000
#: The values of one barrier together (they come back in one ``barrier_values`` reply).
BARRIER_BYTES_MAX = 32 * 1024 * 1024
#: A barrier id: ``<workflow id>.<node>``; the callback's dedup id is ``wf:<barrier id>``.
BARRIER_ID_BYTES_MAX = DEDUP_ID_BYTES_MAX - 3
#: A workflow's record (its steps, zlib-compressed msgpack: design.md, "Workflow records"):
#: one fits a checkpoint record. A chord of BARRIER_MEMBERS_MAX members takes under 1 MiB.
WORKFLOW_SPEC_BYTES_MAX = 8 * 1024 * 1024
#: A progress note (``ctx.progress(fraction, note)``).
PROGRESS_NOTE_BYTES_MAX = 512

# Per shard (configurable in [limits]).
PENDING_JOBS_MAX_DEFAULT = 5_000_000  # backpressure: QueueFull past this many jobs
DEDUP_IDS_MAX_DEFAULT = 5_000_000     # backpressure: QueueFull past this many dedup ids kept
CLIENT_SESSIONS_MAX = 100_000
#: Client connections one shard holds at once; one more is turned away after its handshake
#: with :class:`~shardq.errors.TooManyConnections`.
CONNECTIONS_MAX_DEFAULT = 4096
#: Descriptors a shard needs besides its clients' (log segments, the listener, epoll,
#: pipes, handshakes in progress): it raises its soft RLIMIT_NOFILE to the sum at start.
SHARD_FDS_BESIDES_CLIENTS = 64
#: Queues one shard holds (any name works unless the config declares its queues). Keeps
#: memory (a few KiB per queue) and a stats reply bounded: with 128-byte names a queue's
#: stats take about 435 bytes with every limit (docs/limits.md), 179 without, so at this
#: count a ``stats`` reply is about 43.5 MB (17.9 MB), within REPLY_BYTES_MAX. A scrape's
#: figures add about 255 bytes a queue: 69 MB in all (44.2 MB), past the frame limit, which
#: is why a scrape reads them in pages (METRICS_PAGE_BYTES).
QUEUES_MAX = 100_000
#: What one page of a scrape (a ``metrics_page`` reply) takes at most, estimated from its
#: queues' names and a bound on the rest of a queue's entries (shard/control_handlers.py,
#: QUEUE_FIGURES_BYTES_MAX), never by encoding. At QUEUES_MAX queues with 128-byte names
#: a page holds about 6,500 queues, 4.6 MB encoded with every limit (3.0 MB without), and
#: a scrape of that shard takes 16 pages; the shard's loop pauses for one page at a time
#: (0.14 s at most measured on a loaded 2-CPU VM), not for the whole scrape.
METRICS_PAGE_BYTES = 8 * 1024 * 1024
CLIENT_SESSION_TTL_S = 600.0

# Write-ahead log (configurable in [limits]).
SEGMENT_BYTES_MAX_DEFAULT = 64 * 1024 * 1024
COMPACT_MIN_BYTES_DEFAULT = 64 * 1024 * 1024  # never compact a log smaller than this
# Records, one limit per kind, enforced by the writer (it never produces a larger one) and
# by the reader (it refuses a larger one as corruption). A segment record holds the
# operations of one loop iteration, cut at this size between requests; one request always
# fits, because its frame is at most FRAME_BYTES_MAX and logging adds less than 1 MiB.
SEGMENT_RECORD_BYTES_MAX = FRAME_BYTES_MAX + 1024 * 1024
# A checkpoint record holds as many jobs as fit in CHECKPOINT_CHUNK_BYTES, and at least one
# (a job with a body at the ceiling and every field at its maximum). Small, because a
# damaged record loses its jobs (wal repair salvages every other record); written to the
# file CHECKPOINT_WRITE_BYTES at a time.
CHECKPOINT_CHUNK_BYTES = 4 * 1024
CHECKPOINT_WRITE_BYTES = 1024 * 1024
CHECKPOINT_RECORD_BYTES_MAX = BODY_BYTES_MAX_CEILING + 1024 * 1024

# Shards.
SHARDS_MAX = 1024
JOB_ID_SHARD_BITS = 10  # job_id = (sequence << 10) | shard_index

# Job ids as text (string ids of other backends; the PostgreSQL idempotency store's key).
JOB_ID_STR_BYTES_MAX = 1024

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


# The HTTP listeners of `shardq serve` (metrics and console; the SQS API's too, with its own
# body limit; fixed, not configurable). One event loop holds every connection until its
# request has fully arrived: no thread per connection.
HTTP_CONNECTIONS_MAX = 256               # open at once; past it the longest-waiting unfinished one is closed
HTTP_HEAD_BYTES_MAX = 16 * 1024          # request line and headers, up to the blank line: 431 past it
HTTP_BODY_BYTES_MAX = 1024 * 1024        # a POST body (10,000 ids fit several times over): 413 past it
HTTP_REQUEST_S_MAX = 10.0                # head and body must arrive within this of the connection (or the
                                         # previous response): overall, not per byte; 408 and closed past it
HTTP_WRITE_S_MAX = 10.0                  # a response must be taken by the client within this
HTTP_LINGER_S_MAX = 2.0                  # after refusing a request, what the client still sends is read
                                         # and dropped for at most this long before closing

# The SQS-compatible listener of `shardq serve` (shardq/sqs_api/; AWS's own limits above, plus;
# its connections are the HTTP listener's, HTTP_CONNECTIONS_MAX, on one event loop a process):
SQS_API_PROCESSES_MAX = 64               # [sqs_api] processes: listener processes sharing its port
#: A request body: a message or batch at SQS's 1 MiB however it is encoded. JSON's worst is 6 bytes a
#: byte (a character written \u00XX: botocore's DEL, Go's <>&); the query protocol's 4 (a binary value's
#: base64, each character then percent-encoded; 3 for text). 32 KiB more: the rest of a batch of 10 (Ids,
#: group and dedup ids of 128 characters escaped, trace headers, 100 attributes' keys, the queue URL).
SQS_API_BODY_BYTES_MAX = 6 * SQS_BATCH_BYTES_MAX + 32 * 1024
SQS_API_RECEIVE_MAX = 10                 # ReceiveMessage MaxNumberOfMessages
SQS_API_ENTRY_ID_CHARS_MAX = 80          # a batch entry's Id
SQS_API_LIST_MAX = 1000                  # ListQueues / ListDeadLetterSourceQueues MaxResults
SQS_API_TAGS_MAX = 50                    # tags per queue
SQS_API_ATTRIBUTES_MAX = 10              # message attributes per message
SQS_API_DELAY_S_MAX = 900                # DelaySeconds
SQS_API_CLOCK_SKEW_S = 15 * 60           # a signed request's X-Amz-Date may be this far off
SQS_API_NUMBER_DIGITS_MAX = 38           # a Number message attribute's precision
SQS_API_NUMBER_EXP_MIN = -128            # a nonzero Number is at least 10**this and at most 10**MAX in size
SQS_API_NUMBER_EXP_MAX = 126

# A worker's progress line (shardq/consumer/policy.py), here so that the CLI's parser, built
# by every command, names them without importing the consumer.
LOG_EVERY_S_DEFAULT = 10.0       # a progress line at least this often while jobs finish
LOG_EVERY_S_MAX = 86400.0
