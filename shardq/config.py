"""Configuration: one schema for the TOML file and for the dict given to ``shardq.open``.

Unknown keys and invalid values raise :class:`~shardq.errors.InvalidConfig` naming the key,
so a typo never silently falls back to a default. Times are in seconds.

    [service]                 # the supervisor
    data_dir = "var/shardq"
    shards = 0                # 0 = the data dir's count; a new one gets one shard per two CPUs (at least one)
    health_timeout = 10       # a shard that answers no ping for this long is restarted
    restart_backoff_max = 60  # a crash-looping shard is restarted at most this far apart
    declare_queues = false    # true: only queues listed under [queues] may be used
    busy_poll_us = 300        # a shard polls this long for its next request before it sleeps

    [limits]                  # per shard
    max_pending_jobs = 5000000
    max_dedup_ids = 5000000
    max_connections = 4096
    segment_bytes = 67108864
    compact_min_bytes = 67108864

    [queue_defaults]          # for any queue not listed under [queues]
    visibility_timeout = 30
    max_deliveries = 5
    dedup_window = 300
    max_body_bytes = 262144
    lease_sync = "batched"    # or "strict" (docs/guarantees.md, "Lease durability")
    concurrency = 10          # exact limits (docs/limits.md): any of these places the queue
    rate = "25/s"             #   on one shard; also burst, group_separator, group_concurrency,
                              #   group_rate, fair

    [queues.default]          # per-queue overrides of queue_defaults

    [schedules.cleanup]       # a periodic job, fired by the supervisor (docs/tasks.md)
    cron = "*/5 * * * *"      # or: every_s = 30
    task = "myapp.tasks.cleanup"   # or: body = "text"
    queue = "default"
    key = "cleanup"           # optional
    timezone = "UTC"          # of the cron expression
    catch_up = true           # fire a tick missed while the service was down, once

    [http]                    # metrics and the web console (``shardq serve`` only)
    listen = "127.0.0.1:7781" # "" = off
    token = ""                # or SHARDQ_HTTP_TOKEN; neither: one made in <data dir>/http-token
    auth = "token"            # "none": no token at all (loopback only; any local user may act)
    metrics_public = true     # /metrics without the token, on loopback only
"""
from __future__ import annotations

import dataclasses
import decimal
import ipaddress
import math
import os
import re
import tomllib
import zlib
from dataclasses import dataclass, field
from typing import Any

from . import limits
from .busypoll import BUSY_POLL_US_DEFAULT, BUSY_POLL_US_MAX
from .errors import InvalidConfig
from .schedules import from_config


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Settings of one named queue."""

    visibility_timeout: float = limits.VISIBILITY_TIMEOUT_S_DEFAULT
    max_deliveries: int = limits.MAX_DELIVERIES_DEFAULT
    dedup_window: float = limits.DEDUP_WINDOW_S_DEFAULT
    max_body_bytes: int = limits.BODY_BYTES_MAX_DEFAULT
    #: "batched": a lease of a job whose enqueue is already durable is answered once its
    #: record is written, before its fsync (it becomes durable with the next commit). A
    #: crash of the shard process loses nothing (the kernel holds what was written); only a
    #: crash of the machine (power, kernel) can lose the delivery counts and deadlines of the
    #: leases of the last commit window. "strict": every lease is fsynced before it is
    #: handed out. docs/guarantees.md, "Lease durability".
    lease_sync: str = "batched"
    # Exact limits (docs/limits.md). A queue that sets any of these is *placed*: all its
    # jobs live on one shard (its owner), which enforces every limit with local counters.
    #: at most this many of the queue's leases live at once
    concurrency: int | None = None
    #: at most this many leases started per second/minute/hour: "25/s", "100/m", "5/h"
    rate: str | None = None
    #: tokens of ``rate`` that may accumulate while idle (default: one second's worth, at least 1)
    burst: float | None = None
    #: a job's group is its key up to the first separator (the whole key without one)
    group_separator: str | None = None
    group_concurrency: int | None = None
    group_rate: str | None = None
    #: ready jobs are served round-robin across groups, not in queue order
    fair: bool = False

    def placed(self) -> bool:
        """Whether the queue declares a limit, which places all its jobs on one shard."""
        return (self.concurrency is not None or self.rate is not None or self.burst is not None
                or self.group_separator is not None or self.group_concurrency is not None
                or self.group_rate is not None or self.fair)


LEASE_SYNC_CHOICES = ("batched", "strict")
#: The queue settings that are limits; all but group_separator and fair can change at run time.
LIMIT_KEYS = ("concurrency", "rate", "burst", "group_separator", "group_concurrency", "group_rate", "fair")
RATE_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def owner_shard(queue: str, shards: int) -> int:
    """The shard that holds every job of a placed queue (:meth:`QueueConfig.placed`): a
    stable hash of its name (CRC-32 of the UTF-8 name, mod the shard count, as keys are
    routed), the same in every process and run; a data dir's shard count never changes."""
    return zlib.crc32(queue.encode("utf-8", "surrogatepass")) % shards


def rate_per_s(path: str, value: Any) -> float:
    """A rate written ``"N/s"``, ``"N/m"`` or ``"N/h"`` (N a positive number) in leases per
    second; InvalidConfig naming ``path`` otherwise."""
    if not isinstance(value, str):
        raise InvalidConfig(f"{path}: expected a rate such as \"25/s\", \"100/m\" or \"5/h\", got {value!r}")
    count, sep, unit = value.strip().partition("/")
    try:
        n = float(count) if sep and unit.strip() in RATE_UNITS_S else math.nan
    except ValueError:
        n = math.nan
    if not math.isfinite(n) or n <= 0:
        raise InvalidConfig(f"{path}: expected a rate such as \"25/s\", \"100/m\" or \"5/h\" "
                            f"(a positive number, then /s, /m or /h), got {value!r}")
    per_s = n / RATE_UNITS_S[unit.strip()]
    if not limits.RATE_PER_S_MIN <= per_s <= limits.RATE_PER_S_MAX:
        raise InvalidConfig(f"{path}: {value!r} is {_plain(per_s)}/s, outside [one a day, "
                            f"{_plain(limits.RATE_PER_S_MAX)}/s]")
    return per_s


def _plain(x: float) -> str:
    """``x`` to 10 significant digits, without an exponent ("3000000", "0.00001"), as a rate
    is written in a config."""
    return format(decimal.Decimal(f"{x:.10g}").normalize(), "f")


def _rate(path: str, value: Any) -> str:
    rate_per_s(path, value)  # a str, or InvalidConfig
    return str(value).strip()


def _concurrency(path: str, value: Any) -> int:
    n: int = _number(path, value, integer=True, lo=1, hi=limits.CONCURRENCY_MAX)
    return n


def _burst(path: str, value: Any) -> float:
    x: float = _number(path, value, integer=False, lo=1, hi=limits.BURST_MAX)
    return x


def _separator(path: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limits.GROUP_SEPARATOR_CHARS_MAX:
        raise InvalidConfig(f"{path}: expected a string of 1 to {limits.GROUP_SEPARATOR_CHARS_MAX} "
                            f"characters (such as \"/\"), got {value!r}")
    return value


def check_limits(path: str, q: QueueConfig) -> QueueConfig:
    """The limits of one queue's settings that only make sense together."""
    if q.group_separator is None:
        for key in ("group_concurrency", "group_rate", "fair"):
            if getattr(q, key):
                raise InvalidConfig(f"{path}.{key}: needs {path}.group_separator (what a job's group is)")
    if q.burst is not None and q.rate is None:
        raise InvalidConfig(f"{path}.burst: needs {path}.rate (burst is the tokens of the rate's bucket)")
    return q


def default_shards(cpus: int | None = None) -> int:
    """The shard count of ``service.shards = 0``: one per two of the CPUs this process may
    run on (or ``cpus``), at least one and at most ``limits.SHARDS_MAX`` (which a data dir
    refuses to exceed)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(limits.SHARDS_MAX, max(1, cpus // 2))


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    data_dir: str = "var/shardq"
    shards: int = 0
    health_timeout: float = 10.0
    #: cap of the delay between restarts of a shard that keeps failing (capped exponential
    #: backoff; it is never given up on, except for a corrupt log)
    restart_backoff_max: float = 60.0
    declare_queues: bool = False
    #: how long a shard's loop polls for its next request before it sleeps (0: never;
    #: shardq/busypoll.py)
    busy_poll_us: int = BUSY_POLL_US_DEFAULT
    #: modules whose ``@app.periodic`` schedules the supervisor fires
    schedule_modules: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_pending_jobs: int = limits.PENDING_JOBS_MAX_DEFAULT
    max_dedup_ids: int = limits.DEDUP_IDS_MAX_DEFAULT
    max_connections: int = limits.CONNECTIONS_MAX_DEFAULT
    segment_bytes: int = limits.SEGMENT_BYTES_MAX_DEFAULT
    compact_min_bytes: int = limits.COMPACT_MIN_BYTES_DEFAULT


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """One ``[schedules.<name>]`` table, checked (see :mod:`shardq.schedules`)."""

    cron: str | None = None
    every_s: float | None = None
    task: str | None = None
    body: str | None = None
    queue: str = "default"
    key: str | None = None
    timezone: str = "UTC"
    catch_up: bool = True


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP listener of ``shardq serve`` (metrics, console); see shardq/service/http_server.py."""

    listen: str = "127.0.0.1:7781"
    token: str = field(default="", repr=False)
    auth: str = "token"            # or "none" (loopback only)
    metrics_public: bool = True    # /metrics readable without the token on a loopback listener


@dataclass(frozen=True, slots=True)
class SqsApiConfig:
    """The SQS-compatible listener of ``shardq serve`` (:mod:`shardq.sqs_api`)."""

    listen: str = ""               # "" = off
    region: str = "us-east-1"
    account_id: str = "000000000000"
    access_key_id: str = ""
    secret_access_key: str = field(default="", repr=False)
    processes: int = 1             # listener processes sharing its port (shardq/sqs_api/processes.py)


@dataclass(frozen=True, slots=True)
class Config:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    queue_defaults: QueueConfig = field(default_factory=QueueConfig)
    queues: dict[str, QueueConfig] = field(default_factory=lambda: {"default": QueueConfig()})
    schedules: dict[str, ScheduleConfig] = field(default_factory=dict)
    http: HttpConfig = field(default_factory=HttpConfig)
    sqs_api: SqsApiConfig = field(default_factory=SqsApiConfig)

    def queue(self, name: str) -> QueueConfig | None:
        """The settings of ``name``; None if undeclared and queues must be declared."""
        q = self.queues.get(name)
        if q is not None:
            return q
        return None if self.service.declare_queues else self.queue_defaults

    def resolved_shards(self) -> int:
        """``service.shards``, or by default one shard per two CPUs (at least one): the
        count a new data dir gets (an existing one keeps its own unless a count is given).
        The clients run on the same machine (unix sockets) and need the other half. On 2 CPUs
        one shard serves many clients 1.15-1.40x faster than two (docs/performance.md,
        "How many shards by default")."""
        return self.service.shards or default_shards()

    def to_dict(self) -> dict[str, Any]:
        """The config as the TOML schema, less secrets (``http.token``): this dict travels on
        shard command lines, which every local user can read. ``sqs_api`` is left out whole:
        the shards never use it, and its keys are only valid together."""
        return {
            "service": dataclasses.asdict(self.service),
            "limits": dataclasses.asdict(self.limits),
            "queue_defaults": _unset_left_out(self.queue_defaults),
            "queues": {n: _unset_left_out(q) for n, q in self.queues.items()},
            "schedules": {n: {k: v for k, v in dataclasses.asdict(sc).items() if v is not None}
                          for n, sc in self.schedules.items()},
            "http": {"listen": self.http.listen, "auth": self.http.auth,
                     "metrics_public": self.http.metrics_public},
        }


def _unset_left_out(q: QueueConfig) -> dict[str, Any]:
    """A queue's settings as the TOML schema: a limit that is not set has no key (TOML has no null)."""
    return {k: v for k, v in dataclasses.asdict(q).items() if v is not None}


def _number(path: str, value: Any, *, integer: bool, lo: float, hi: float) -> Any:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise InvalidConfig(f"{path}: expected {kind}, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidConfig(f"{path}: {value!r} is outside [{lo}, {hi}]")
    return value if integer else float(value)


_QUEUE_BOUNDS: dict[str, tuple[bool, float, float]] = {
    "visibility_timeout": (False, 0.001, limits.VISIBILITY_TIMEOUT_S_MAX),
    "max_deliveries": (True, 1, 1_000_000),
    "dedup_window": (False, 0, 7 * 24 * 3600.0),
    "max_body_bytes": (True, 1, limits.BODY_BYTES_MAX_CEILING),
}
_SERVICE_BOUNDS: dict[str, tuple[bool, float, float]] = {
    "shards": (True, 0, limits.SHARDS_MAX),
    "health_timeout": (False, 0.1, 3600.0),
    "restart_backoff_max": (False, 0.5, 3600.0),
    "busy_poll_us": (True, 0, BUSY_POLL_US_MAX),
}
#: Keys that no longer exist, and what replaced them (an old config gets this, not "unknown key").
_SERVICE_REMOVED = {
    "restart_limit": "a shard that keeps failing is no longer given up on: it is restarted with capped "
                     "exponential backoff (service.restart_backoff_max); remove this key",
    "restart_window": "see service.restart_backoff_max; remove this key",
}
_LIMITS_BOUNDS: dict[str, tuple[bool, float, float]] = {
    "max_pending_jobs": (True, 1, 10**9),
    "max_dedup_ids": (True, 1, 10**9),
    "max_connections": (True, 1, 2**20),
    "segment_bytes": (True, 4096, 2**40),
    "compact_min_bytes": (True, 4096, 2**40),
}


def _lease_sync(path: str, value: Any) -> str:
    if value not in LEASE_SYNC_CHOICES:
        raise InvalidConfig(f"{path}: expected one of {', '.join(map(repr, LEASE_SYNC_CHOICES))}, got {value!r}")
    return str(value)


_QUEUE_CHOICES: dict[str, Any] = {"lease_sync": _lease_sync}  # and the limits, once their checkers are defined


def _section(path: str, raw: Any, base: Any, bounds: dict[str, tuple[bool, float, float]],
             extra: dict[str, Any] | None = None) -> Any:
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}: expected a table, got {raw!r}")
    values = {}
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key in bounds:
            integer, lo, hi = bounds[key]
            values[key] = _number(where, value, integer=integer, lo=lo, hi=hi)
        elif extra and key in extra:
            values[key] = extra[key](where, value)
        elif path == "service" and key in _SERVICE_REMOVED:
            raise InvalidConfig(f"{where}: removed: {_SERVICE_REMOVED[key]}")
        else:
            raise InvalidConfig(f"{where}: unknown key")
    return dataclasses.replace(base, **values)


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidConfig(f"{path}: expected a non-empty string, got {value!r}")
    return value


def _boolean(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{path}: expected true or false, got {value!r}")
    return value


def _modules(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) and m for m in value):
        raise InvalidConfig(f"{path}: expected a list of module names, got {value!r}")
    return tuple(value)


def _every(path: str, value: Any) -> float:
    x: float = _number(path, value, integer=False, lo=1.0, hi=366 * 86400.0)
    return x


def _schedule(name: Any, raw: Any) -> ScheduleConfig:
    where = f"schedules.{name}"
    if not isinstance(name, str) or not name:
        raise InvalidConfig(f"{where}: a schedule name must be a non-empty string")
    sc: ScheduleConfig = _section(where, raw, ScheduleConfig(), {}, {
        "cron": _string, "every_s": _every, "task": _string, "body": _string, "queue": _string,
        "key": _string, "timezone": _string, "catch_up": _boolean})
    if (sc.cron is None) == (sc.every_s is None):
        raise InvalidConfig(f"{where}: give exactly one of cron and every_s")
    if (sc.task is None) == (sc.body is None):
        raise InvalidConfig(f"{where}: give exactly one of task and body")
    check_queue_name(sc.queue, InvalidConfig)
    # the cron expression, time zone and name are checked here; the body is the scheduler's to
    # encode (shardq.tasks.body, a layer above), so any non-empty stand-in checks the rest
    from_config(name, sc, task_body=str.encode)
    return sc


_QUEUE_CHOICES.update({"concurrency": _concurrency, "rate": _rate, "burst": _burst,
                       "group_separator": _separator, "group_concurrency": _concurrency,
                       "group_rate": _rate, "fair": _boolean})


def check_limit(path: str, key: str, value: Any) -> Any:
    """One limit's value (a key of :data:`LIMIT_KEYS`) checked as the config checks it:
    InvalidConfig naming ``path`` (``shardq queue limit`` and the shard check run-time
    changes with it)."""
    if key not in LIMIT_KEYS:
        raise InvalidConfig(f"{path}: not a limit (one of {', '.join(LIMIT_KEYS)})")
    return _QUEUE_CHOICES[key](path, value)


def parse(raw: dict[str, Any]) -> Config:
    """Validate a config dict (the TOML schema) into a :class:`Config`."""
    if not isinstance(raw, dict):
        raise InvalidConfig(f"config: expected a table, got {raw!r}")
    unknown = set(raw) - {"service", "limits", "queue_defaults", "queues", "schedules", "http", "sqs_api"}
    if unknown:
        raise InvalidConfig(f"{sorted(unknown)[0]}: unknown key")
    service = _section("service", raw.get("service", {}), ServiceConfig(), _SERVICE_BOUNDS,
                       {"data_dir": _string, "declare_queues": _boolean, "schedule_modules": _modules})
    lim = _section("limits", raw.get("limits", {}), LimitsConfig(), _LIMITS_BOUNDS)
    defaults = check_limits("queue_defaults", _section("queue_defaults", raw.get("queue_defaults", {}),
                                                         QueueConfig(), _QUEUE_BOUNDS, _QUEUE_CHOICES))
    raw_queues = raw.get("queues", {"default": {}})
    if not isinstance(raw_queues, dict):
        raise InvalidConfig(f"queues: expected a table, got {raw_queues!r}")
    queues = {}
    for name, q in raw_queues.items():
        check_queue_name(name, InvalidConfig)
        queues[name] = check_limits(f"queues.{name}", _section(f"queues.{name}", q, defaults, _QUEUE_BOUNDS,
                                                               _QUEUE_CHOICES))
    raw_schedules = raw.get("schedules", {})
    if not isinstance(raw_schedules, dict):
        raise InvalidConfig(f"schedules: expected a table, got {raw_schedules!r}")
    schedules = {name: _schedule(name, sc) for name, sc in raw_schedules.items()}
    for name, sc in schedules.items():  # else every tick fails with UnknownQueue, forever
        if service.declare_queues and sc.queue not in queues:
            raise InvalidConfig(f"schedules.{name}.queue: queue {sc.queue!r} is not declared "
                                f"(service.declare_queues = true): add [queues.{sc.queue}]")
    http = _section("http", raw.get("http", {}), HttpConfig(), {},
                    {"listen": _listen, "token": _token, "auth": _http_auth, "metrics_public": _boolean})
    _check_http(http)
    sqs_api = _section("sqs_api", raw.get("sqs_api", {}), SqsApiConfig(),
                       {"processes": (True, 1, limits.SQS_API_PROCESSES_MAX)},
                       {"listen": _listen, "region": _region, "account_id": _account_id,
                        "access_key_id": _access_key_id, "secret_access_key": _secret_access_key})
    _check_sqs_api(sqs_api)
    return Config(service=service, limits=lim, queue_defaults=defaults, queues=queues,
                  schedules=schedules, http=http, sqs_api=sqs_api)


HTTP_TOKEN_CHARS_MIN = 16
HTTP_AUTH_MODES = ("token", "none")


def _listen(path: str, value: Any) -> str:
    """``"host:port"`` (``"[::1]:7781"`` for IPv6; port 0 = any free port) or ``""`` (off)."""
    if not isinstance(value, str):
        raise InvalidConfig(f"{path}: expected \"host:port\" or \"\", got {value!r}")
    if value:
        split_listen(value, path)
    return value


LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, ``[::1]`` too) is this machine's loopback."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_listen(value: str, path: str = "http.listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidConfig(f"{path}: expected \"host:port\" (port 0-65535), got {value!r}")
    return host, int(port)


def _http_auth(path: str, value: Any) -> str:
    if value not in HTTP_AUTH_MODES:
        raise InvalidConfig(f"{path}: expected one of {', '.join(map(repr, HTTP_AUTH_MODES))}, got {value!r}")
    return str(value)


def _check_http(http: HttpConfig) -> None:
    """``auth = "none"`` only where nobody but this machine's users can connect, and never
    next to a token (which the operator would believe protects the listener)."""
    if http.auth != "none":
        return
    if http.token:
        raise InvalidConfig("http.auth = \"none\" contradicts http.token: remove one of them")
    if http.listen:
        host, _ = split_listen(http.listen)
        if not is_loopback(host):
            raise InvalidConfig(f"http.auth = \"none\" is allowed on a loopback listen address only, "
                                f"not {http.listen!r}: anyone who can reach it could read jobs and "
                                f"pause, cancel and purge")


_REGION = re.compile(r"[a-z]{2}(-[a-z0-9]+)+-[0-9]+\Z")
_ACCOUNT_ID = re.compile(r"[0-9]{12}\Z")
_ACCESS_KEY_ID = re.compile(r"[A-Za-z0-9]{16,128}\Z")
SQS_SECRET_CHARS_MIN = 16


def _region(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _REGION.match(value):
        raise InvalidConfig(f"{path}: expected an AWS region name such as \"us-east-1\", got {value!r}")
    return value


def _account_id(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _ACCOUNT_ID.match(value):
        raise InvalidConfig(f"{path}: expected 12 digits (a string, such as \"000000000000\"), got {value!r}")
    return value


def _access_key_id(path: str, value: Any) -> str:
    if not isinstance(value, str) or (value and not _ACCESS_KEY_ID.match(value)):
        raise InvalidConfig(f"{path}: expected \"\" or 16 to 128 letters and digits (as AWS key ids are), "
                            f"got {value!r}")
    return value


def _secret_access_key(path: str, value: Any) -> str:
    if not isinstance(value, str) or (value and (len(value) < SQS_SECRET_CHARS_MIN or not value.isascii()
                                                 or not value.isprintable())):
        raise InvalidConfig(f"{path}: expected \"\" or a secret of at least {SQS_SECRET_CHARS_MIN} printable "
                            f"ASCII characters")
    return value


def _check_sqs_api(cfg: SqsApiConfig) -> None:
    """Keys both set or both unset; without keys (no signature checked), a loopback listener
    only: anyone who can reach it could read and delete every message."""
    if bool(cfg.access_key_id) != bool(cfg.secret_access_key):
        missing = "secret_access_key" if cfg.access_key_id else "access_key_id"
        raise InvalidConfig(f"sqs_api.{missing}: set both access_key_id and secret_access_key, or neither")
    if cfg.listen and not cfg.access_key_id:
        host, _ = split_listen(cfg.listen, "sqs_api.listen")
        if not is_loopback(host):
            raise InvalidConfig(f"sqs_api.listen {cfg.listen!r} is not a loopback address: set "
                                f"sqs_api.access_key_id and sqs_api.secret_access_key (without them no "
                                f"signature is checked, and anyone who can reach it could read and delete "
                                f"every message)")


def _token(path: str, value: Any) -> str:
    if not isinstance(value, str) or (value and len(value) < HTTP_TOKEN_CHARS_MIN):
        raise InvalidConfig(f"{path}: expected \"\" or a secret of at least {HTTP_TOKEN_CHARS_MIN} characters")
    return value


def load(source: str | os.PathLike[str] | dict[str, Any] | Config | None) -> Config:
    """A :class:`Config` from a TOML path, a dict of the same schema, or None (defaults)."""
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, dict):
        return parse(source)
    try:
        with open(source, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise InvalidConfig(f"{source}: {e}") from None
    except OSError as e:
        raise InvalidConfig(f"{source}: cannot read: {e.strerror}") from None
    return parse(raw)


def check_queue_name(name: Any, error: type[Exception]) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > limits.QUEUE_NAME_BYTES_MAX:
        raise error(f"queue name must be a non-empty string of at most "
                    f"{limits.QUEUE_NAME_BYTES_MAX} bytes, got {name!r:.160}")
    return name
