"""The exact limits of one placed queue on its shard (docs/limits.md): concurrency caps and
token buckets, per queue and per group, and the order in which a grouped queue's ready jobs
are served (queue order, or round-robin across groups with ``fair``). Pure: no I/O, no
clock (``now`` comes from the caller), nothing logged here; what a limit changes at run time
is a logged operation of the state (``ops.LIMITS``), applied through :meth:`Limiter.change`.

Why each bound holds (the state calls this module; the proofs are in docs/limits.md):

* **In flight** is the number of the queue's live leases on this shard: ``counts[LEASED]``
  of its :class:`~.core.QueueState`, and per group :attr:`GroupLine.inflight`, kept by the
  one place a job changes state (``StateCore._set`` calls :meth:`Limiter.moved`). Replay
  and checkpoints rebuild both by applying the same operations, so a restart knows every
  lease that is live; an expired lease leaves LEASED in ``advance`` and gives its slot back.
* **Tokens** are not logged: every bucket starts *empty* the first time this process uses
  the limiter (``start``), and a group's bucket that is not kept reads as one created empty
  then. Over any 1-s window the leases started are at most the tokens held at its start
  (at most ``burst``) plus what refills during it (``rate``), also across a restart: the
  bucket after it starts from nothing.
* **A held-back job** is never moved: it stays in its line (its place kept) and nothing is
  logged or counted for it.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import Any, NamedTuple

from .. import limits
from ..config import LIMIT_KEYS, QueueConfig, check_limit, check_limits, rate_per_s
from ..errors import InvalidConfig
from .jobstate import R

_EPS = limits.TOKEN_EPSILON

# Where a group line stands (GroupLine.where).
IDLE, ACTIVE, AT_CAP, NO_TOKEN = 0, 1, 2, 3
#: The settings ``shardq queue limit`` may change at run time (group_separator and fair
#: shape the queue's lines and its placement: config only).
RUNTIME_KEYS = ("concurrency", "rate", "burst", "group_concurrency", "group_rate")


class Settings(NamedTuple):
    """The limits in force, rates in leases per second (None: no such limit)."""
    concurrency: int | None
    rate: float | None
    burst: float
    group_concurrency: int | None
    group_rate: float | None
    group_burst: float


def settings(cfg: QueueConfig, override: dict[str, Any] | None = None) -> Settings:
    """The limits of ``cfg``, with the run-time ``override`` (a logged ``LIMITS``
    operation's values: a key present replaces the config's, None removing the limit)."""
    values = {k: getattr(cfg, k) for k in RUNTIME_KEYS}
    if override:
        values.update({k: v for k, v in override.items() if k in RUNTIME_KEYS})
    rate = rate_per_s("rate", values["rate"]) if values["rate"] is not None else None
    group_rate = rate_per_s("group_rate", values["group_rate"]) if values["group_rate"] is not None else None
    burst = values["burst"]
    # one second's worth, at least one token (a bucket below one would never lease)
    burst = float(burst) if burst is not None and rate is not None else max(1.0, rate or 1.0)
    return Settings(values["concurrency"], rate, burst, values["group_concurrency"], group_rate,
                    max(1.0, group_rate or 1.0))


def check_override(values: Any, cfg: QueueConfig, earlier: dict[str, Any] | None = None,
                   path: str = "limits") -> dict[str, Any]:
    """A run-time change of limits, checked exactly as the config checks a queue's limits:
    each value by ``config.check_limit``, and the limits in force afterwards (``cfg`` with
    the ``earlier`` override and this change applied) by ``config.check_limits``, the
    config's own function, so a ``burst`` without a ``rate`` (or a group limit without the
    config's ``group_separator``) is refused here as it is there. InvalidConfig names the
    key under ``path`` (``queues.NAME``). Returns the merged override: ``{key: value or
    None}`` over :data:`RUNTIME_KEYS`, None meaning that limit removed."""
    if type(values) is dict and values and (shape := [k for k in values if k in LIMIT_KEYS and k not in RUNTIME_KEYS]):
        raise InvalidConfig(f"{path}.{shape[0]}: set in the config only, read when serve starts (it decides how the "
                            f"queue's jobs are grouped); change it there and restart. At run time: "
                            f"{', '.join(RUNTIME_KEYS)}")
    if type(values) is not dict or not values or not set(values) <= set(RUNTIME_KEYS):
        raise InvalidConfig(f"limits: expected a map of some of {', '.join(RUNTIME_KEYS)}, got {values!r:.80}")
    merged = dict(earlier or {})
    merged.update({k: None if v is None else check_limit(f"{path}.{k}", k, v) for k, v in values.items()})
    check_limits(path, dataclasses.replace(cfg, **merged))
    return merged


class Bucket:
    """A token bucket; ``at`` None: as if created empty when its limiter started."""

    __slots__ = ("tokens", "at")

    def __init__(self) -> None:
        self.tokens = 0.0
        self.at: float | None = None

    def level(self, now: float, rate: float, burst: float, start: float) -> float:
        if self.at is None:
            return min(burst, rate * max(now - start, 0.0))
        return min(burst, self.tokens + rate * max(now - self.at, 0.0))

    def spend(self, now: float, rate: float, burst: float, start: float) -> None:
        self.tokens = self.level(now, rate, burst, start) - 1.0
        self.at = now

    def due(self, now: float, rate: float, burst: float, start: float, want: float = 1.0) -> float:
        """When the bucket holds ``want`` tokens (now, or later)."""
        short = want - self.level(now, rate, burst, start)
        return now if short <= _EPS else now + short / rate


class GroupLine:
    """One group of a grouped queue: its ready jobs (a heap: highest priority, then the
    order they became ready), its leases in flight, its bucket, and where it stands."""

    __slots__ = ("heap", "inflight", "bucket", "where", "head")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Any]] = []  # (-priority, ready seq, job)
        self.inflight = 0
        self.bucket = Bucket()
        self.where = IDLE
        self.head: tuple[int, int] | None = None    # the key of its live entry in Limiter.active (not fair)


class Limiter:
    """The limits of one placed queue on this shard; see the module docstring."""

    def __init__(self, cfg: QueueConfig) -> None:
        self.cfg = cfg
        self.sep = cfg.group_separator
        self.fair = cfg.fair
        self.override: dict[str, Any] | None = None
        self.s = settings(cfg)
        self.start: float | None = None   # the first moment this process used the limits
        self.bucket = Bucket()
        self.max_seen = 0                 # the most leases in flight at once since this process started
        self.group_max_seen = 0
        self.lines: dict[str | None, GroupLine] = {}
        self._seq = 0
        # ACTIVE groups: a deque in turn (fair), or a heap of (head key, group) (queue order)
        self.turns: deque[str | None] = deque()
        self.order: list[tuple[tuple[int, int], str | None]] = []
        #: (when a token is due, a tiebreak, group): never two groups compared, as None (the
        #: keyless jobs' group) and a name cannot be (a tie shut the shard down: TypeError)
        self.no_token: list[tuple[float, int, str | None]] = []
        self.emptied: list[tuple[float, int, str | None]] = []    # idle lines to drop once their bucket is full
        #: nothing is leased before this time: leases a power cut may have taken from the
        #: log can still be running (boot_fence.py); 0: no fence
        self.fence_until = 0.0

    # ------------------------------------------------------------------ settings
    def change(self, override: dict[str, Any] | None) -> None:
        """Apply a run-time change (None: back to the config). Buckets keep their tokens,
        cut to the new burst; every held-back group is looked at again."""
        self.override = override or None
        self.s = settings(self.cfg, self.override)
        self.bucket.tokens = min(self.bucket.tokens, self.s.burst)
        for g, line in list(self.lines.items()):
            line.bucket.tokens = min(line.bucket.tokens, self.s.group_burst)
            if line.where in (AT_CAP, NO_TOKEN):
                self._activate(g, line)
        self.no_token.clear()

    def begin(self, now: float) -> float:
        """The moment the limits started in this process: every bucket was empty then."""
        if self.start is None:
            self.start = now
        return self.start

    # ------------------------------------------------------------------ the queue-wide limits
    def allowance(self, inflight: int, now: float) -> int:
        """How many leases the queue-wide limits allow now (a large number: no such limit)."""
        if now < self.fence_until:
            return 0
        s, start = self.s, self.begin(now)
        n = limits.BATCH_JOBS_MAX
        if s.concurrency is not None:
            n = min(n, s.concurrency - inflight)
        if s.rate is not None:
            n = min(n, int(self.bucket.level(now, s.rate, s.burst, start) + _EPS))
        return max(n, 0)

    def spent(self, leased: int, inflight: int, now: float) -> None:
        """``leased`` leases were just started; ``inflight`` is the count now."""
        s = self.s
        if s.rate is not None:
            for _ in range(leased):
                self.bucket.spend(now, s.rate, s.burst, self.begin(now))
        if inflight > self.max_seen:
            self.max_seen = inflight

    def next_token(self, now: float) -> float | None:
        """When the queue's bucket next holds a token, if it holds none now (or when the
        fence ends, while it holds)."""
        if now < self.fence_until:
            return self.fence_until
        s = self.s
        if s.rate is None:
            return None
        due = self.bucket.due(now, s.rate, s.burst, self.begin(now))
        return due if due > now else None

    # ------------------------------------------------------------------ groups
    def group(self, key: str | None) -> str | None:
        return None if key is None else key.partition(self.sep)[0]  # type: ignore[arg-type]  # grouped: sep set

    def push(self, job: Any) -> None:
        """``job`` (of this grouped queue) became READY: it joins the end of its group's
        line (within its priority)."""
        g = self.group(job.key)
        line = self.lines.get(g)
        if line is None:
            line = self.lines[g] = GroupLine()
        self._seq += 1
        entry = (-job.priority, self._seq, job)
        heapq.heappush(line.heap, entry)
        if line.where == IDLE:
            self._activate(g, line)
        elif line.where == ACTIVE and not self.fair and line.heap[0] is entry:
            line.head = entry[:2]  # a better head: its entry replaces the old one
            heapq.heappush(self.order, (line.head, g))

    def moved(self, job: Any, left: bool, entered: bool) -> None:
        """``job`` left LEASED and/or entered it (``StateCore._set``): its group's count."""
        g = self.group(job.key)
        line = self.lines.get(g)
        if line is None:
            line = self.lines[g] = GroupLine()
        line.inflight += entered - left
        if left and line.where == AT_CAP:
            cap = self.s.group_concurrency
            if cap is None or line.inflight < cap:
                self._activate(g, line)
        if line.inflight > self.group_max_seen:
            self.group_max_seen = line.inflight
        if not line.inflight and line.where == IDLE and not line.heap:
            self._forget(g, line)

    def _activate(self, g: str | None, line: GroupLine) -> None:
        if not line.heap:
            line.where = IDLE  # nothing ready: its next ready job activates it
            return
        line.where = ACTIVE
        if self.fair:
            self.turns.append(g)
        else:
            line.head = line.heap[0][:2]
            heapq.heappush(self.order, (line.head, g))

    def _forget(self, g: str | None, line: GroupLine) -> None:
        """An idle, empty line goes once its bucket is full (the same as no bucket)."""
        s = self.s
        if s.group_rate is None or self.start is None:
            if s.group_rate is None:
                del self.lines[g]
            else:  # replay: looked at once the limiter runs
                heapq.heappush(self.emptied, (0.0, self._next(), g))
            return
        due = line.bucket.due(self.start, s.group_rate, s.group_burst, self.start, s.group_burst)
        heapq.heappush(self.emptied, (due, self._next(), g))

    def first(self, now: float) -> GroupLine | None:
        """The line whose head is served next: the next group in turn (fair) or the group
        with the best head (queue order), skipping groups a limit holds back. A held-back
        group leaves the turn with its jobs in place and comes back when a slot frees
        (:meth:`moved`) or its next token is due (:meth:`refresh`)."""
        start = self.begin(now)
        self.refresh(now)
        s = self.s
        while True:
            if self.fair:
                if not self.turns:
                    return None
                g = self.turns[0]
                line = self.lines.get(g)
                if line is None or line.where != ACTIVE:
                    self.turns.popleft()
                    continue
            else:
                if not self.order:
                    return None
                key, g = self.order[0]
                line = self.lines.get(g)
                if line is None or line.where != ACTIVE or key != line.head:
                    heapq.heappop(self.order)  # stale
                    continue
            heap = line.heap
            while heap and heap[0][2].state is not R:
                heapq.heappop(heap)  # left by replay, or cancelled while ready
            if not heap:
                self._pop_turn()
                line.where = IDLE
                if not line.inflight:
                    self._forget(g, line)
                continue
            if not self.fair and heap[0][:2] != line.head:
                heapq.heappop(self.order)
                line.head = heap[0][:2]
                heapq.heappush(self.order, (line.head, g))
                continue
            if s.group_concurrency is not None and line.inflight >= s.group_concurrency:
                self._pop_turn()
                line.where = AT_CAP
                continue
            if s.group_rate is not None:
                due = line.bucket.due(now, s.group_rate, s.group_burst, start)
                if due > now:
                    self._pop_turn()
                    line.where = NO_TOKEN
                    heapq.heappush(self.no_token, (due, self._next(), g))
                    continue
            return line

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _pop_turn(self) -> None:
        if self.fair:
            self.turns.popleft()
        else:
            heapq.heappop(self.order)

    def take(self, line: GroupLine, now: float, leased: bool) -> Any:
        """Take the head of ``line`` (just returned by :meth:`first`); ``leased``: it is
        being leased (a token is spent), not dead-lettered. The group goes to the back of
        the turn (fair) or keeps its place by its next head."""
        job = heapq.heappop(line.heap)[2]
        self._pop_turn()
        s = self.s
        if leased and s.group_rate is not None:
            line.bucket.spend(now, s.group_rate, s.group_burst, self.begin(now))
        g = self.group(job.key)
        if line.heap:
            self._activate(g, line)
        else:
            line.where = IDLE
            if not leased and not line.inflight:
                self._forget(g, line)
        return job

    def refresh(self, now: float) -> None:
        """Groups whose next token has come are served again; idle lines whose bucket has
        filled are dropped."""
        no_token = self.no_token
        while no_token and no_token[0][0] <= now:
            _, _, g = heapq.heappop(no_token)
            line = self.lines.get(g)
            if line is not None and line.where == NO_TOKEN:
                self._activate(g, line)
        emptied, s = self.emptied, self.s
        while emptied and emptied[0][0] <= now:
            _, _, g = heapq.heappop(emptied)
            line = self.lines.get(g)
            if line is None or line.where != IDLE or line.heap or line.inflight:
                continue
            if s.group_rate is None:
                del self.lines[g]
                continue
            due = line.bucket.due(now, s.group_rate, s.group_burst, self.begin(now), s.group_burst)
            if due <= now:
                del self.lines[g]
            else:
                heapq.heappush(emptied, (due, self._next(), g))

    def next_group_token(self, now: float) -> float | None:
        """When the next held-back group's token is due (later than ``now``; an entry of a
        group served again since only wakes the shard once for nothing)."""
        self.refresh(now)
        return self.no_token[0][0] if self.no_token else None

    # ------------------------------------------------------------------ figures
    def figures(self, inflight: int, ready: int, now: float) -> dict[str, Any]:
        """What ``stats`` shows of the limits: in flight against the caps, tokens, jobs held back."""
        s, start = self.s, self.begin(now)
        if inflight > self.max_seen:  # leases replay restored, which no lease call counted
            self.max_seen = inflight
        out: dict[str, Any] = {"in_flight": inflight, "max_in_flight_seen": self.max_seen}
        queue_held = now < self.fence_until
        if queue_held:
            out["fenced_until"] = self.fence_until
        if s.concurrency is not None:
            out["concurrency"] = s.concurrency
            queue_held = queue_held or inflight >= s.concurrency
        if s.rate is not None:
            tokens = self.bucket.level(now, s.rate, s.burst, start)
            out.update(rate_per_s=s.rate, burst=s.burst, tokens=round(tokens, 3))
            queue_held = queue_held or tokens < 1 - _EPS
        if self.sep is not None:
            out.update(group_separator=self.sep, fair=self.fair, groups=len(self.lines),
                       max_group_in_flight_seen=self.group_max_seen)
            if s.group_concurrency is not None:
                out["group_concurrency"] = s.group_concurrency
            if s.group_rate is not None:
                out.update(group_rate_per_s=s.group_rate, group_burst=s.group_burst)
            # A group's ``where`` is brought up to date when a dequeue looks at it: one that its
            # last lease brought to its cap, or out of tokens, is held back before that
            held_groups = [line for line in self.lines.values() if line.heap and (
                line.where in (AT_CAP, NO_TOKEN)
                or (s.group_concurrency is not None and line.inflight >= s.group_concurrency)
                or (s.group_rate is not None and line.bucket.due(now, s.group_rate, s.group_burst, start) > now))]
            out["groups_held_back"] = len(held_groups)
            group_held = sum(len(line.heap) for line in held_groups)  # may count an entry left by replay
        else:
            group_held = 0
        out["held_back"] = ready if queue_held else min(group_held, ready)
        if self.override:
            out["runtime_override"] = dict(self.override)
        return out
