"""The scheduler: a thread of the supervisor that fires periodic jobs (the I/O shell around
the pure :mod:`.schedules`).

Each tick is enqueued through a :class:`~shardq.client.queue.Queue` with the tick's
``dedup_id``, *then* recorded as the schedule's last tick in ``<data dir>/schedules.json``
(temp file, fsync, rename, fsync of the directory; :class:`State` says what it holds). So a
tick is fired at least once, and a second firing is a no-op at the queue: after a crash
between the enqueue and the record,
the restarted scheduler fires the same tick with the same dedup id. (Only if that restart
comes later than the queue's ``dedup_window`` can such a tick be enqueued twice.) The
supervisor's lock on the data dir makes it the only scheduler of that data dir.

A failed enqueue (a shard down, QueueFull) leaves the tick unrecorded; it is tried again a
second later. A schedule whose tick cannot be worked out or sent (an error of its own) is
logged as ``event=schedule-error schedule=<name>`` and tried again a second later; the
other schedules fire as usual.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import TYPE_CHECKING, NamedTuple

from ..clock import Clock, SystemClock
from ..errors import InvalidConfig, ShardqError
from ..schedules import Schedule, from_config, iso, plan
from ..types import JobId
from ..tasks.body import encode

if TYPE_CHECKING:
    from ..client.queue import Queue
    from ..config import Config

log = logging.getLogger("shardq.scheduler")

STATE_FILE = "schedules.json"
WAKE_S_MAX = 1.0      # longest sleep: also how soon a failed enqueue is retried
STATE_FORMAT = 1


def collect_schedules(config: Config) -> list[Schedule]:
    """The config's ``[schedules.*]`` and the ``@app.periodic`` schedules of the modules in
    ``service.schedule_modules`` (imported with the current directory on sys.path).
    InvalidConfig if two of them share a name, or if an ``@app.periodic`` one names a queue
    that ``service.declare_queues = true`` does not have (the config's own schedules are
    checked when the config is parsed: :func:`shardq.config.parse`)."""
    import sys
    out = [from_config(name, sc, task_body=lambda task: encode(task, (), {}))
           for name, sc in config.schedules.items()]
    modules = list(config.service.schedule_modules)
    if modules:
        from ..tasks.dispatch import load_apps
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            apps = load_apps(modules)
        except ImportError as exc:
            raise InvalidConfig(f"service.schedule_modules: cannot import: {exc}") from None
        for app in apps:
            for s in app.schedules:
                if config.queue(s.queue) is None:
                    raise InvalidConfig(f"service.schedule_modules: the @app.periodic schedule {s.name!r} "
                                        f"sends to queue {s.queue!r}, which is not declared "
                                        f"(service.declare_queues = true): add [queues.{s.queue}]")
            out.extend(app.schedules)
    seen: set[str] = set()
    for s in out:
        if s.name in seen:
            where = (f"[schedules.{s.name}] and an @app.periodic schedule" if s.name in config.schedules
                     else "two @app.periodic schedules")
            raise InvalidConfig(f"service.schedule_modules: two schedules are named {s.name!r} ({where}): "
                                "rename one (@app.periodic(name=...))")
        seen.add(s.name)
    return out


def state_path(data_dir: str) -> str:
    return os.path.join(data_dir, STATE_FILE)


class State(NamedTuple):
    """What ``schedules.json`` keeps, per schedule name.

    ``last``: every tick up to this one is settled, fired or skipped (``catch_up = false``);
    for a schedule not fired yet, the start of the scheduler that first saw it (nothing before
    it is owed). :func:`~shardq.schedules.plan` reads it. ``fired``: the last tick enqueued;
    no entry for a schedule never fired (nor in a file written before shardq kept it: older
    versions read the file as before, ignoring this key)."""

    last: dict[str, float]
    fired: dict[str, float]


def load_state(path: str) -> State:
    """The record at ``path``. Missing file: empty; an unreadable one is logged and treated
    as missing (the dedup ids still stop a repeated tick)."""
    try:
        with open(path, "rb") as f:
            raw = json.load(f)
        if raw.get("format") != STATE_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}")
        return State(last={str(k): float(v) for k, v in raw["last"].items()},
                     fired={str(k): float(v) for k, v in raw.get("fired", {}).items()})
    except FileNotFoundError:
        return State({}, {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("event=schedule-state-unreadable path=%s error=%s", path, exc)
        return State({}, {})


def save_state(path: str, state: State) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": STATE_FORMAT, "last": state.last, "fired": state.fired}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Scheduler:
    """Fires ``schedules`` into ``queue``; ``start()`` runs it in a thread, ``run_once(now)``
    is one step (tests call it with a fake clock)."""

    def __init__(self, schedules: list[Schedule], queue: Queue, data_dir: str, clock: Clock | None = None):
        names = [s.name for s in schedules]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ShardqError(f"two schedules are named {dup!r}")
        self.schedules = schedules
        self.queue = queue
        self.path = state_path(data_dir)
        self.clock = clock or SystemClock()
        self.started_at = self.clock.now()
        self.last, self.last_fired = load_state(self.path)  # (State.last, State.fired)
        self.fired = 0
        self.errors = 0  # schedule-error: a schedule whose ticks could not be worked out
        self._failing: dict[str, str] = {}  # schedule name -> its error, while it fails
        self._lock = threading.Lock()  # run_once from the thread and from a test
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def run_once(self, now: float | None = None) -> list[tuple[str, float, JobId]]:
        """Fire what is due at ``now``; returns ``[(name, tick, job_id), ...]``."""
        with self._lock:
            return self._run_once(self.clock.now() if now is None else now)

    def _run_once(self, now: float) -> list[tuple[str, float, JobId]]:
        out: list[tuple[str, float, JobId]] = []
        changed = False
        for i, s in enumerate(self.schedules):
            if i:  # an enqueue before this one may have taken a while
                now = max(now, self.clock.now())
            try:
                tick, new_last = plan(s, self.last.get(s.name), now, self.started_at)
            except Exception as exc:  # noqa: BLE001 - this schedule's own fault: the others still fire
                self._failed(s, exc)
                continue
            if tick is not None:
                try:
                    job_id = self.queue.enqueue(s.body, key=s.key, queue=s.queue, dedup_id=s.dedup_id(tick))
                except ShardqError as exc:
                    log.warning("event=schedule-fire-failed schedule=%s tick=%s error=%s: %s",
                                s.name, iso(tick), type(exc).__name__, exc)
                    continue  # not recorded: tried again on the next wake
                except Exception as exc:  # noqa: BLE001 - not the queue's refusal: this schedule's fault
                    self._failed(s, exc)
                    continue  # not recorded either
                log.info("event=schedule-fired schedule=%s tick=%s job=%s late_s=%.3f",
                         s.name, iso(tick), job_id, self.clock.now() - tick)
                out.append((s.name, tick, job_id))
                self.fired += 1
                self.last_fired[s.name] = tick
                changed = True
            self._failing.pop(s.name, None)
            if self.last.get(s.name) != new_last:
                self.last[s.name] = new_last
                changed = True
        if changed:
            try:
                save_state(self.path, State(self.last, self.last_fired))
            except OSError as exc:
                log.warning("event=schedule-state-write-failed path=%s error=%s", self.path, exc)
        return out

    def _failed(self, s: Schedule, exc: Exception) -> None:
        """A schedule whose tick cannot be worked out or sent (an error of its own, not the
        queue's refusal, which is schedule-fire-failed): it fires nothing, it is tried again on
        the next wake, and the other schedules go on. Logged on every try, with the traceback
        when the error is new (not the one this schedule failed with on its last try)."""
        error = f"{type(exc).__name__}: {exc}"
        first = self._failing.get(s.name) != error
        self._failing[s.name] = error
        self.errors += 1
        log.error("event=schedule-error schedule=%s error=%s", s.name, error, exc_info=first)

    def next_wake_s(self, now: float) -> float:
        due = now + WAKE_S_MAX
        for s in self.schedules:
            try:
                due = min(due, s.next_after(max(now, self.last.get(s.name, now))))
            except Exception:  # noqa: BLE001 - logged by run_once (schedule-error); tried within WAKE_S_MAX
                pass
        return min(max(due - now, 0.0), WAKE_S_MAX)

    # ------------------------------------------------------------------ thread
    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._loop, name="shardq-scheduler", daemon=True)
        self._thread.start()
        return self

    def poke(self) -> None:
        """Wake the thread now (tests that moved a fake clock)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop:
            try:
                self.run_once()
                wait = self.next_wake_s(self.clock.now())
            except Exception:  # never let a bad tick end the scheduler
                log.exception("event=scheduler-error")
                wait = WAKE_S_MAX
            self._wake.wait(wait)
            self._wake.clear()
