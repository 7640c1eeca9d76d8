"""Periodic jobs: when each schedule's ticks fall, and which tick to fire now. Pure: no I/O,
no clock (every function takes ``now``), so tests drive it with any time they like.

A schedule ticks on a cron expression (5 fields, evaluated in its ``timezone``, with
daylight-saving changes handled by ``croniter``) or every ``every_s`` seconds (ticks at the
multiples of ``every_s`` since the epoch, so every process agrees on them). Each tick is
enqueued with ``dedup_id = "<name>:<tick time, UTC ISO 8601>"``: a restart, a second
supervisor or a clock step that fires the same tick again within the queue's
``dedup_window`` adds nothing.

:func:`plan` decides, from the last tick fired (kept by the scheduler across restarts),
the clock and when this scheduler started:

* ticks are fired in order and never twice: only ticks after the last one fired count,
  so a clock stepped backwards fires nothing until it passes that tick again;
* several ticks due at once (the process stalled, the clock jumped forward) fire **once**,
  as the latest of them: a pause never becomes a burst;
* a tick that fell while no scheduler ran (before ``started_at``) was missed: it is fired
  once on start with ``catch_up = true`` (the default), skipped with ``catch_up = false``.
"""
from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from . import limits
from .errors import InvalidConfig

if TYPE_CHECKING:
    from .config import ScheduleConfig

EVERY_S_MIN = 1.0
EVERY_S_MAX = 366 * 86400.0
#: the dedup id is "<name>:YYYY-MM-DDTHH:MM:SSZ" and must fit limits.DEDUP_ID_BYTES_MAX
NAME_BYTES_MAX = limits.DEDUP_ID_BYTES_MAX - len(":2026-01-01T00:00:00Z")


@dataclass(frozen=True)
class Schedule:
    """One periodic job: what to enqueue (``body`` on ``queue`` with ``key``) and when."""

    name: str
    queue: str
    body: bytes
    key: str | None = None
    cron: str | None = None
    every_s: float | None = None
    timezone: str = "UTC"
    catch_up: bool = True
    task: str | None = None  # the task name the body calls, for display

    @classmethod
    def create(cls, name: str, *, queue: str, body: bytes, key: str | None = None,
               cron: str | None = None, every_s: float | None = None, timezone: str = "UTC",
               catch_up: bool = True, task: str | None = None, where: str | None = None) -> Schedule:
        """A checked schedule; InvalidConfig names the problem (``where``: the config path)."""
        at = where or f"schedule {name!r}"
        if not isinstance(name, str) or not name or len(name.encode()) > NAME_BYTES_MAX or ":" in name:
            raise InvalidConfig(f"{at}: a schedule name is a non-empty string of at most "
                                f"{NAME_BYTES_MAX} bytes without ':'")
        if (cron is None) == (every_s is None):
            raise InvalidConfig(f"{at}: give exactly one of cron and every_s")
        if cron is not None and (not isinstance(cron, str) or len(cron.split()) != 5
                                 or not _croniter().is_valid(cron)):
            raise InvalidConfig(f"{at}.cron: {cron!r} is not a 5-field cron expression")
        if every_s is not None and (isinstance(every_s, bool) or not isinstance(every_s, (int, float))
                                    or not EVERY_S_MIN <= every_s <= EVERY_S_MAX):
            raise InvalidConfig(f"{at}.every_s: expected a number in [{EVERY_S_MIN:.0f}, {EVERY_S_MAX:.0f}]")
        try:
            ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise InvalidConfig(f"{at}.timezone: unknown time zone {timezone!r}") from None
        if not isinstance(catch_up, bool):
            raise InvalidConfig(f"{at}.catch_up: expected true or false")
        if not isinstance(body, bytes) or not body:
            raise InvalidConfig(f"{at}: the body must be non-empty bytes")
        return cls(name=name, queue=queue, body=body, key=key, cron=cron,
                   every_s=float(every_s) if every_s is not None else None, timezone=timezone,
                   catch_up=catch_up, task=task)

    # ------------------------------------------------------------------ ticks
    def next_after(self, t: float) -> float:
        """The first tick strictly after ``t`` (epoch seconds)."""
        if self.every_s is not None:
            return (math.floor(t / self.every_s) + 1) * self.every_s
        start = dt.datetime.fromtimestamp(math.floor(t), ZoneInfo(self.timezone))
        return float(_croniter()(self.cron, start).get_next(float))

    def last_at_or_before(self, t: float) -> float:
        """The latest tick at or before ``t``."""
        if self.every_s is not None:
            return math.floor(t / self.every_s) * self.every_s
        start = dt.datetime.fromtimestamp(math.floor(t) + 1, ZoneInfo(self.timezone))
        return float(_croniter()(self.cron, start).get_prev(float))

    def dedup_id(self, tick: float) -> str:
        return f"{self.name}:{iso(tick)}"

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron!r} ({self.timezone})"
        return f"every {self.every_s:g} s"


def plan(schedule: Schedule, last: float | None, now: float, started_at: float) -> tuple[float | None, float]:
    """``(tick to fire or None, the new last tick)``. ``last`` is the last tick fired, or
    None for a schedule never seen: then nothing from before ``started_at`` is owed."""
    if last is None:
        last = started_at
    latest = schedule.last_at_or_before(now)
    if latest <= last:
        return None, last  # nothing new (or the clock went back: wait until it passes ``last``)
    if latest >= started_at or schedule.catch_up:
        return latest, latest
    return None, latest  # missed while down, catch_up = false: skipped


def from_config(name: str, sc: ScheduleConfig, task_body: Callable[[str], bytes]) -> Schedule:
    """The schedule of a ``[schedules.<name>]`` table (a :class:`~shardq.config.ScheduleConfig`):
    ``task`` becomes ``task_body(task)`` (the scheduler passes the task body of a call with no
    arguments, :func:`shardq.tasks.body.encode`), ``body`` its UTF-8 bytes."""
    if sc.task is not None:
        body = task_body(sc.task)
    elif sc.body is not None:
        body = sc.body.encode("utf-8")
    else:  # the config refuses a schedule with neither: this is a caller's own ScheduleConfig
        raise InvalidConfig(f"schedule {name!r} has neither task nor body")
    return Schedule.create(name, queue=sc.queue, body=body, key=sc.key, cron=sc.cron,
                           every_s=sc.every_s, timezone=sc.timezone, catch_up=sc.catch_up,
                           task=sc.task, where=f"schedules.{name}")


def iso(t: float) -> str:
    """``t`` as UTC ISO 8601 to the second: ``2026-11-30T20:05:00Z``."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def local_iso(t: float, timezone: str) -> str:
    return dt.datetime.fromtimestamp(t, ZoneInfo(timezone)).isoformat(timespec="seconds")


def _croniter() -> Any:  # (croniter has no types)
    """croniter, imported on first use: every process that reads a config imports this
    module (a shard, each CLI command), and most never meet a cron schedule."""
    from croniter import croniter as cls
    return cls
