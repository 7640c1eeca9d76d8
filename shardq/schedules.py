"""Periodic jobs: when each schedule's ticks fall, and which tick to fire now. Pure: no I/O,
no clock (every function takes ``now``), so tests drive it with any time they like.

A schedule ticks on a cron expression (5 fields, read on the wall clock of its
``timezone``) or every ``every_s`` seconds (ticks at the multiples of ``every_s`` since the
epoch, so every process agrees on them). ``croniter`` only finds the wall-clock times that
match; which instants they are is decided here, as cronie (Vixie cron) decides it when the
clocks change (its cron(8), "Daylight Saving Time and other time changes"; ``find_jobs`` in
its cron.c). A *fixed-time* expression, whose minute and hour fields both start with
something else than ``*`` (``30 2 * * *``, ``0 9,17 * * 1-5``), fires once for each
matching wall-clock time, whatever the clocks do:

* a wall-clock time that happens twice (the clocks go back) fires at its first pass only;
* a wall-clock time that does not happen (the clocks go forward) fires at the change, the
  first instant after the skipped interval (several such times are one tick).

Any other expression (``*/15 * * * *``, ``0 * * * *``, ``0 */2 * * *``) fires at every
matching wall-clock time that happens: at both passes of a repeated hour, not at all in a
skipped one.

Each tick is enqueued with ``dedup_id = "<name>:<tick time, UTC ISO 8601>"``: a restart, a second
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
        if cron is not None and any(f.upper() == "R" or f.upper().startswith("R(")
                                    for field in cron.split() for f in field.split(",")):
            raise InvalidConfig(f"{at}.cron: {cron!r}: R (croniter's random value) picks another "
                                f"time at every look, so a tick would fire many times: write the time out")
        if cron is not None and not _can_fire(cron):
            raise InvalidConfig(f"{at}.cron: {cron!r} matches no date (a day that no month "
                                f"has, such as 30 February or 31 April): it would never fire")
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
        return _next_tick(self._cron(), ZoneInfo(self.timezone), math.floor(t))

    def last_at_or_before(self, t: float) -> float:
        """The latest tick at or before ``t``."""
        if self.every_s is not None:
            return math.floor(t / self.every_s) * self.every_s
        return _last_tick(self._cron(), ZoneInfo(self.timezone), math.floor(t))

    def _cron(self) -> str:
        if self.cron is None:  # a Schedule built without create()
            raise InvalidConfig(f"schedule {self.name!r}: give exactly one of cron and every_s")
        return self.cron

    def dedup_id(self, tick: float) -> str:
        return f"{self.name}:{iso(tick)}"

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron!r} ({self.timezone})"
        return f"every {self.every_s:g} s"


DAY_S = 86400


def fixed_time(cron: str) -> bool:
    """cronie's fixed-time job (no MIN_STAR or HR_STAR flag in its entry.c): neither the
    minute nor the hour field starts with ``*``. See the module's docstring."""
    minute, hour = cron.split()[:2]
    return not minute.startswith("*") and not hour.startswith("*")


#: where :func:`_can_fire` starts looking: any date would do (croniter looks at most
#: ``max_years_between_matches``, 50, years ahead; the calendar repeats every 400 years, but
#: a day of the month and a day of the week in one expression are either-or, as in cron, so a
#: date that matches at all comes round within 8 years, 29 February in a leap year).
_CAN_FIRE_FROM = dt.datetime(2000, 1, 1)


def _day_or(cron: str) -> bool:
    """cron's rule: the day of the month and the day of the week are either-or only when
    neither field starts with ``*`` (cronie's DOM_STAR/DOW_STAR); else both must match."""
    dom, dow = cron.split()[2], cron.split()[4]
    return not (dom.startswith("*") or dow.startswith("*"))


def _can_fire(cron: str) -> bool:
    """Whether a (valid) cron expression matches any date at all: ``0 0 30 2 *`` (30
    February) never does, and croniter can find no tick of it (CroniterBadDateError)."""
    from croniter import CroniterBadDateError
    try:
        _croniter()(cron, _CAN_FIRE_FROM, day_or=_day_or(cron)).get_next(dt.datetime)
    except CroniterBadDateError:
        return False
    return True


def _next_tick(cron: str, tz: ZoneInfo, now: int) -> float:
    """The first instant after ``now`` at which a wall time matching ``cron`` fires."""
    fixed = fixed_time(cron)
    # In the first pass of a repeated hour, a wall time before now's fires again after now
    # (its second pass): start that much earlier (by the offset's fall in the next day).
    back_s = max(_offset_s(now, tz) - _offset_s(now + DAY_S, tz), 0)
    walls = _croniter()(cron, _wall(now, tz) - dt.timedelta(seconds=back_s), day_or=_day_or(cron))
    best = math.inf
    while True:
        at = _instants(walls.get_next(dt.datetime), tz, fixed)
        best = min([best, *(x for x in at if x > now)])
        if at and at[0] > now:  # every later wall time fires at or after at[0]
            return best


def _last_tick(cron: str, tz: ZoneInfo, now: int) -> float:
    """The last instant at or before ``now`` at which a wall time matching ``cron`` fires."""
    fixed = fixed_time(cron)
    # In the second pass of a repeated hour, a wall time after now's fired in the first
    # pass: start that much later (by the offset's fall in the last day).
    ahead_s = max(_offset_s(now - DAY_S, tz) - _offset_s(now, tz), 0)
    walls = _croniter()(cron, _wall(now, tz) + dt.timedelta(seconds=ahead_s + 1), day_or=_day_or(cron))
    best = -math.inf
    while True:
        at = _instants(walls.get_prev(dt.datetime), tz, fixed)
        best = max([best, *(x for x in at if x <= now)])
        if at and at[-1] <= now:  # every earlier wall time fires at or before at[-1]
            return best


def _instants(wall: dt.datetime, tz: ZoneInfo, fixed: bool) -> list[float]:
    """When the local (naive) time ``wall`` fires, in order: once; in a repeated hour at both
    passes, or at the first only if ``fixed``; in a skipped hour never, or at the change if
    ``fixed``. (zoneinfo reads a skipped time with the offset before the change at fold=0,
    with the one after at fold=1; a repeated one at its first pass at fold=0.)"""
    first = wall.replace(tzinfo=tz, fold=0).timestamp()
    second = wall.replace(tzinfo=tz, fold=1).timestamp()
    if first == second:
        return [first]
    if first < second:
        return [first] if fixed else [first, second]
    return [float(_change(math.floor(second), math.ceil(first), tz))] if fixed else []


def _change(before: int, after: int, tz: ZoneInfo) -> int:
    """The instant in ``(before, after]`` at which ``tz`` leaves the offset it has at
    ``before`` (the tz database changes offsets on whole seconds)."""
    old = _offset_s(before, tz)
    while after - before > 1:
        mid = (before + after) // 2
        if _offset_s(mid, tz) == old:
            before = mid
        else:
            after = mid
    return after


def _offset_s(t: int, tz: ZoneInfo) -> float:
    offset = dt.datetime.fromtimestamp(t, tz).utcoffset()
    return offset.total_seconds() if offset is not None else 0.0


def _wall(t: int, tz: ZoneInfo) -> dt.datetime:
    """The local time of ``t``, naive (croniter then does calendar arithmetic on it alone)."""
    return dt.datetime.fromtimestamp(t, tz).replace(tzinfo=None, fold=0)


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
