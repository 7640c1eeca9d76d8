"""``WorkerOptions``: one frozen, validated record of a worker's settings, for every runner.

The thread and process runner (:class:`~shardq.consumer.worker.Worker`) and the asyncio
runner (:class:`~shardq.consumer.aioworker.AsyncWorker`) take one; their keyword
constructors (``Worker(q, handler, concurrency=4, burst=True)``) build it. Every limit is
checked here, once, when the record is made: a bad value is :class:`~shardq.errors.InvalidConfig`
before a worker exists, whichever runner it was meant for. What is not a setting (the
queue client, the handler, the idempotency store, the clock, the random source, the metrics)
is passed to the runner beside the record.
"""
from __future__ import annotations

import dataclasses
import enum
import numbers

from .. import limits
from ..config import check_queue_name
from ..errors import InvalidConfig
from ..limits import LOG_EVERY_S_DEFAULT
from .policy import Burst, check_progress

CONCURRENCY_MAX = 1024           # handlers (threads, processes, asyncio tasks) of one worker
POLL_S = 0.1                     # longest the threaded loop blocks while handlers run
IDLE_WAIT_S = 1.0                # long-poll wait of dequeue when nothing is in flight
PRUNE_EVERY_S = 3600.0           # idempotency store pruning period


class Mode(enum.StrEnum):
    """Where the threaded runner runs handlers: its threads, or a pool of processes."""

    THREAD = "thread"
    PROCESS = "process"


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """A worker's settings. ``prefetch`` None: ``max(1, concurrency // 4)`` (the record
    holds the number). ``burst``: False, True (return once this queue is drained) or a
    :class:`~shardq.consumer.policy.Burst` shared with other workers. ``mode`` and
    ``prefetch`` are the threaded runner's (the asyncio runner starts a job as soon as it
    is leased); ``request_timeout_s`` the asyncio runner's, for the client it connects."""

    queue: str = "default"
    concurrency: int = 8
    mode: Mode = Mode.THREAD
    prefetch: int | None = None
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    heartbeat_fraction: float = 0.5
    grace_s: float = 30.0
    log_every: int = 1000
    log_every_s: float = LOG_EVERY_S_DEFAULT
    poll_s: float = POLL_S
    idle_wait_s: float = IDLE_WAIT_S
    prune_every_s: float | None = PRUNE_EVERY_S
    request_timeout_s: float = 5.0
    burst: bool | Burst | None = False

    def __post_init__(self) -> None:
        c = self.concurrency
        _require(_is_int(c) and 1 <= c <= CONCURRENCY_MAX,
                 f"concurrency must be an int in [1, {CONCURRENCY_MAX}], got {c!r}")
        prefetch = max(1, c // 4) if self.prefetch is None else self.prefetch
        _require(_is_int(prefetch) and 0 <= prefetch <= c, f"prefetch must be an int in [0, concurrency = {c}], "
                                                            f"got {prefetch!r}")
        object.__setattr__(self, "prefetch", prefetch)
        _require(self.mode in ("thread", "process"), f"mode must be 'thread' or 'process', got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        _require(_is_number(self.heartbeat_fraction) and 0 < self.heartbeat_fraction < 1,
                 f"heartbeat_fraction must be in (0, 1), got {self.heartbeat_fraction!r}")
        _require(_is_number(self.backoff_base_s) and _is_number(self.backoff_cap_s)
                 and 0 <= self.backoff_base_s <= self.backoff_cap_s <= limits.DELAY_S_MAX,
                 f"need 0 <= backoff_base_s <= backoff_cap_s <= limits.DELAY_S_MAX, got {self.backoff_base_s!r} "
                 f"and {self.backoff_cap_s!r}")
        for name, low, value in (("grace_s", 0, self.grace_s), ("poll_s", None, self.poll_s),
                                 ("idle_wait_s", 0, self.idle_wait_s)):
            _require(_is_number(value) and (value > 0 if low is None else value >= low),
                     f"{name} must be a number of seconds {'> 0' if low is None else '>= 0'}, got {value!r}")
        _require(self.prune_every_s is None or (_is_number(self.prune_every_s) and self.prune_every_s > 0),
                 f"prune_every_s must be None or a number of seconds > 0, got {self.prune_every_s!r}")
        _require(_is_number(self.request_timeout_s) and self.request_timeout_s > 0,
                 f"request_timeout_s must be a number of seconds > 0, got {self.request_timeout_s!r}")
        check_progress(self.log_every, self.log_every_s)
        if self.burst is not None and not isinstance(self.burst, (bool, Burst)):
            raise InvalidConfig(f"burst must be a bool or a Burst, not {type(self.burst).__name__}")
        check_queue_name(self.queue, InvalidConfig)  # (an empty one failed only at the first dequeue)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidConfig(message)


def options_of(options: WorkerOptions | None, settings: dict[str, object]) -> WorkerOptions:
    """A runner's ``options`` argument, or the record its keyword settings make (the
    keyword constructors of the runners); both at once is refused."""
    if options is None:
        return WorkerOptions(**settings)  # type: ignore[arg-type]  # checked in __post_init__
    if not isinstance(options, WorkerOptions):
        raise InvalidConfig(f"options must be a WorkerOptions, not {type(options).__name__}")
    if settings:
        raise InvalidConfig(f"give options or settings ({', '.join(sorted(settings))}), not both")
    return options
