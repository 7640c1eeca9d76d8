"""What a reload of the config file (SIGHUP to ``shardq serve``) changes: pure, no I/O.

:func:`plan` compares the config in force with the one just read and sorts every key that
differs into two lists:

* **applied** at once: the queue settings of ``[queue_defaults]`` and ``[queues.*]``
  (``visibility_timeout``, ``max_deliveries``, ``dedup_window``, ``max_body_bytes``,
  ``lease_sync``; a queue added or removed) and ``service.restart_backoff_max``. A shard
  reads a queue's settings on every request, and nothing it logs depends on them (a
  lease's deadline, a dedup id's expiry are written as times), so the new values govern
  the next dequeue, enqueue, nack and lease expiry, and replay is unchanged;
* **needs a restart** of ``serve``: everything else, each with why (:class:`Change`'s
  ``why``, logged). Of these, :attr:`Plan.refused` are the changes a restart cannot take
  either: ``service.shards`` (but to 0, or to the data dir's count) and ``service.data_dir``
  are fixed for the data dir (serve refuses another shard count, ShardCountMismatch, exit 5;
  another data dir is another service, without this one's jobs), so they are reported with
  :data:`WHY_REFUSED`'s why, as refused, not as waiting for a restart. ``[limits]``, the rest of
  ``[service]``, ``[schedules.*]``, ``[http]`` and ``[sqs_api]`` are set up once, when a
  shard or the supervisor starts (the SQS listener's socket is bound, and its keys
  checked together, before any shard starts). So are a queue's exact limits (``concurrency``, ``rate``, ...:
  config.LIMIT_KEYS), and a queue that declares one, added or removed: limits place a
  queue's jobs on one shard (docs/limits.md; ``shardq queue limit`` changes a placed
  queue's limits at run time). Applying those at once was weighed and left: a new
  schedule, a new placed queue and new limits each need the start-up path (placement,
  the scheduler's state) re-run safely in a running service.

:attr:`Plan.config` is the config in force afterwards: the old one with the applied keys
replaced, so a shard that restarts later starts with the same settings as its peers, and
no shard takes a "needs a restart" value until ``serve`` itself restarts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, NamedTuple

from ..config import LIMIT_KEYS, Config, QueueConfig, SqsApiConfig

APPLIED_KEYS = ("service.restart_backoff_max",)
QUEUE_TABLES = ("queue_defaults", "queues")
SECRET = "<secret>"
#: Keys whose values are never logged: a change shows as SECRET (set) or "" (unset).
SECRET_KEYS = frozenset({"http.token", "sqs_api.secret_access_key"})
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


#: Why a change waits for a restart of ``serve``: logged with each such key (``why=``), and
#: the table of docs/operations.md ("Reloading"), which a test holds to these.
WHY_LIMIT = "a queue's limits are set when serve starts (shardq queue limit changes them at run time)"
WHY_PLACED = "a queue that declares a limit is placed on one shard when serve starts"
WHY_TABLE = {
    "service": "set when serve starts",
    "limits": "a shard's limits are set when serve starts",
    "schedules": "the schedules are read when serve starts",
    "http": "the HTTP listener is set up when serve starts",
    "sqs_api": "the SQS listener is set up when serve starts",
}


#: Why a change is refused (:attr:`Plan.refused`): a restart of ``serve`` cannot take it either.
WHY_REFUSED = {
    "service.shards": "fixed for this data dir: serve will not start with another shard count "
                      "(ShardCountMismatch, exit 5); put the old value back, or 0 (the data dir's count)",
    "service.data_dir": "fixed for this data dir: a restart would serve another data dir, without this "
                        "one's jobs; put the old value back",
}


class Change(NamedTuple):
    key: str          # dotted, as in the file: "queues.emails.max_deliveries"
    old: Any          # None: absent (or unset) before
    new: Any          # None: absent (or unset) now
    why: str = ""     # why it waits for a restart; "" for a change applied at once


class Plan(NamedTuple):
    applied: list[Change]
    #: every change not applied, each with why; the :attr:`refused` ones among them (a
    #: caller that predates :attr:`refused` logs them with the rest, their why says so)
    restart: list[Change]
    config: Config

    @property
    def refused(self) -> list[Change]:
        """The changes of :attr:`restart` that a restart of ``serve`` cannot take either:
        report them as refused (why: :data:`WHY_REFUSED`), not as waiting for a restart."""
        return [c for c in self.restart if WHY_REFUSED.get(c.key) == c.why]

    @property
    def pending(self) -> list[Change]:
        """The changes of :attr:`restart` that take effect when ``serve`` restarts."""
        return [c for c in self.restart if WHY_REFUSED.get(c.key) != c.why]


def _toml_key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


def _diff(old: Any, new: Any, path: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys(), key=str):
            _diff(old.get(key), new.get(key), f"{path}.{key}" if path else str(key), out)
    elif old != new:
        out.append(Change(path, old, new))


def _queue_changes(path: str, old: QueueConfig, new: QueueConfig, plan_: Plan) -> None:
    for f in dataclasses.fields(QueueConfig):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            if f.name in LIMIT_KEYS:
                plan_.restart.append(Change(f"{path}.{f.name}", a, b, WHY_LIMIT))
            else:
                plan_.applied.append(Change(f"{path}.{f.name}", a, b))


def _keep_limits(new: QueueConfig, old: QueueConfig) -> QueueConfig:
    """``new`` with the limits of ``old``: those wait for a restart."""
    return dataclasses.replace(new, **{k: getattr(old, k) for k in LIMIT_KEYS})


def _refused(c: Change, shards: int | None) -> bool:
    """Whether ``c`` is a change that a restart of ``serve`` refuses (``shards``: the data
    dir's shard count, None when not known)."""
    if c.key == "service.shards":  # 0: the data dir's count, whatever it is
        return c.new not in (0, None) and c.new != shards
    if c.key == "service.data_dir":
        return not (isinstance(c.old, str) and isinstance(c.new, str)
                    and os.path.normpath(c.old) == os.path.normpath(c.new))
    return False


def plan(old: Config, new: Config, *, shards: int | None = None) -> Plan:
    """Sort the changes from ``old`` to ``new``; the config in force afterwards. ``shards``:
    the data dir's shard count (the supervisor's), so that ``service.shards`` changed to it
    is not refused; None: any other count than 0 is."""
    p = Plan([], [], old)
    _queue_changes("queue_defaults", old.queue_defaults, new.queue_defaults, p)
    queues: dict[str, QueueConfig] = {}
    for name in sorted(old.queues.keys() & new.queues.keys()):
        _queue_changes(f"queues.{_toml_key(name)}", old.queues[name], new.queues[name], p)
        queues[name] = _keep_limits(new.queues[name], old.queues[name])
    for name in sorted(old.queues.keys() ^ new.queues.keys()):  # removed or added
        added = name in new.queues
        q = new.queues[name] if added else old.queues[name]
        change = Change(f"queues.{_toml_key(name)}", None if added else "declared", "declared" if added else None)
        if q.placed():  # a placed queue comes and goes with a restart only
            p.restart.append(change._replace(why=WHY_PLACED))
            if not added:
                queues[name] = q
        else:
            p.applied.append(change)
            if added:
                queues[name] = q
    others: list[Change] = []
    _diff({k: v for k, v in old.to_dict().items() if k not in QUEUE_TABLES},
          {k: v for k, v in new.to_dict().items() if k not in QUEUE_TABLES}, "", others)
    if old.http.token != new.http.token:  # to_dict leaves secrets out; never log one
        others.append(Change("http.token", SECRET if old.http.token else "", SECRET if new.http.token else ""))
    # to_dict leaves [sqs_api] out whole (the shards never read it): compared key by key
    for f in dataclasses.fields(SqsApiConfig):
        a, b = getattr(old.sqs_api, f.name), getattr(new.sqs_api, f.name)
        if a != b:
            key = f"sqs_api.{f.name}"
            if key in SECRET_KEYS:
                a, b = SECRET if a else "", SECRET if b else ""
            others.append(Change(key, a, b))
    for c in others:
        if c.key in APPLIED_KEYS:
            p.applied.append(c)
        elif _refused(c, shards):
            p.restart.append(c._replace(why=WHY_REFUSED[c.key]))
        else:
            p.restart.append(c._replace(why=WHY_TABLE.get(c.key.split(".", 1)[0], "read when serve starts")))
    config = dataclasses.replace(
        old, queue_defaults=_keep_limits(new.queue_defaults, old.queue_defaults), queues=queues,
        service=dataclasses.replace(old.service, restart_backoff_max=new.service.restart_backoff_max))
    return Plan(p.applied, p.restart, config)
