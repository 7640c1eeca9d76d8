"""The outbox relay: moves committed outbox rows into the queue, each exactly once (within
the dedup window) and, per key, in row order, with any number of relays running.

One batch is one PostgreSQL transaction::

    BEGIN
    SELECT the oldest rows FOR UPDATE SKIP LOCKED LIMIT n    -- other relays skip these
    keep, per key, the rows no older row of that key is outside this batch (see below)
    INSERT INTO <table>_attempts  (own connection, committed)  -- before the send: its age is known
    queue.enqueue_many(rows, dedup_id="outbox:<scope>:<id>")  -- one shard's rows at a time
    DELETE the rows the queue has and their attempts; NOTIFY the other relays
    DELETE the attempts of rows no request carried (sending.py)
    COMMIT

A crash anywhere before the COMMIT leaves the rows in the table (the server rolls back the
dead connection's transaction), so they are sent again; the queue answers a repeated
``dedup_id`` within its ``dedup_window`` (counted from the first enqueue) with the first
job and adds nothing. That holds only while the first send is younger than the window: a
row whose first attempt is older than the window minus a margin is not sent again, and
the relay stops with :class:`~shardq.errors.OutboxBehind` (docs/guarantees.md says what to
do). Rows never sent are safe at any age: a batch that fails with an error proving that
some of its rows were never taken by the queue (a service that is down; ``sending.py`` says
which errors prove it) drops their new attempt marks as it commits, with the deletes of the
rows the queue did take, then backs off. Attempt marks whose row is gone (deleted by hand
after an ``OutboxBehind``) are not counted by :func:`status` and are removed by the relay
every ``ORPHANS_S``.

Per-key order across relays: a relay sends a row of key K only if every older row of K it
can see is in its own batch, before it. Rows of K held by another relay block K (their
relay sends them; once it commits, they are gone and K moves on). A relay that dies
releases its rows, which are then the oldest again. Keyless rows have no order.

A row the queue refuses (``InvalidJob``: a body over the queue's limit, an undeclared queue;
``Unsupported``: a feature the backend lacks, such as a delay or a priority on SQS) is moved
to ``<table>_rejected`` with the error, never retried and never a stop: the rows behind it
move on. At start the relay records in ``<table>_meta`` which job fields its queue refuses
(``refuses``), so that :func:`~shardq.outbox.enqueue` refuses such rows in the caller's
transaction instead.

LISTEN/NOTIFY: the insert trigger (schema.py) and each relay's commit notify the table's
channel; a relay with nothing to do sleeps on it, polling every ``poll_s`` as a safety net.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import limits, pgconn
from ..client.queue import Queue
from ..clock import Clock, SystemClock
from ..consumer.handling import error_text
from ..stopping import install_stop_signals, restore_signals
from ..errors import InvalidConfig, OutboxBehind, StoreUnavailable, UnknownQueue
from .schema import TABLE_DEFAULT, channel, install
from .sending import RETRIED, send

log = logging.getLogger("shardq.outbox")

BATCH_ROWS_DEFAULT = 500
BATCH_ROWS_MAX = limits.BATCH_JOBS_MAX          # one enqueue request per shard: all or nothing
BATCH_BYTES_MAX = limits.FRAME_BYTES_MAX // 2   # bodies per batch; a larger first row goes alone
POLL_S_DEFAULT = 5.0          # wake up this often with no notification (a safety net)
DEDUP_MARGIN_S = 10.0         # a first send must be younger than the dedup window minus
DEDUP_MARGIN_FRACTION = 0.1   # max(10 s, 10% of it): clock skew, time between check and send
SAFE_WINDOW_S_MIN = 30.0      # queues with a shorter usable window are refused
BACKOFF_S_MIN, BACKOFF_S_MAX = 0.1, 5.0
STOP_CHECK_S = 0.2            # longest a wait goes without looking at stop()
HELD_RETRY_S = 0.05           # rows waiting behind another relay's: look again this soon
ORPHANS_S = 60.0              # remove attempt marks whose row is gone this often (and at the first batch)


def refused_fields(queue: Queue) -> tuple[str, ...]:
    """The job fields (``delay``, ``priority``) ``queue`` refuses when not at their default,
    as its backend declares them (``refuses``); none for the local shards."""
    fields = getattr(queue, "refuses", ())
    return tuple(sorted(f for f in fields if f in ("delay", "priority")))


if TYPE_CHECKING:
    from psycopg import Connection


class _Conns(NamedTuple):
    """A relay's three sessions: batches, attempt marks (autocommit), and LISTEN."""
    main: Connection[Any]
    marks: Connection[Any]
    listen: Connection[Any]


class _Row(NamedTuple):
    id: int
    queue: str
    key: str | None
    priority: int
    delay_s: float
    body_bytes: int
    attempted_ago: float | None   # seconds since a relay first sent it; None: never


class _Sent(NamedTuple):
    """A batch's :class:`~.sending.Outcome`, as rows."""
    sent: list[_Row]
    rejected: list[tuple[_Row, str]]
    unsent: list[_Row]
    error: Exception | None


@dataclasses.dataclass
class RelayStats:
    batches: int = 0      # transactions that moved rows
    moved: int = 0        # rows the queue acknowledged (and deleted here)
    rejected: int = 0     # rows the queue refused (InvalidJob, Unsupported): moved to <table>_rejected
    resent: int = 0       # rows sent again after an earlier relay's attempt (deduplicated)
    unavailable: int = 0  # batches rolled back because the database or the queue failed


class Relay:
    """Moves rows of the outbox ``table`` in the database at ``dsn`` into ``queue``. See
    the module docstring. ``run()`` loops until :meth:`stop` (or SIGTERM/SIGINT in the main
    thread); :meth:`relay_batch` moves one batch."""

    def __init__(self, dsn: str, queue: Queue, *, table: str = TABLE_DEFAULT,
                 batch_rows: int = BATCH_ROWS_DEFAULT, poll_s: float = POLL_S_DEFAULT,
                 clock: Clock | None = None):
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) \
                or not 1 <= batch_rows <= BATCH_ROWS_MAX:
            raise InvalidConfig(f"batch_rows must be an int in [1, {BATCH_ROWS_MAX}], got {batch_rows!r}")
        if not 0 < poll_s <= 3600:
            raise InvalidConfig(f"poll_s must be in (0, 3600], got {poll_s!r}")
        if not isinstance(dsn, str):
            raise InvalidConfig(f"outbox relay: dsn must be a string, got {type(dsn).__name__}")
        pgconn.psycopg()
        self.table = pgconn.TableName(table)
        self._dsn, self._q = dsn, queue
        self._batch_rows, self._poll_s = batch_rows, float(poll_s)
        self._clock = clock or SystemClock()
        self._conns: _Conns | None = None
        self._scope: str | None = None
        self._held = 0  # rows the last batch locked but had to leave for per-key order
        self._orphans_at = float("-inf")  # when (self._clock.monotonic()) to remove orphan marks next
        self._stopping = False
        self.waiting = False  # True while idle, listening on the channel
        self.stats = RelayStats()
        t, a = self.table.q(), self.table.q("_attempts")
        self._sql = {
            "lock": (f"SELECT o.id, o.queue, o.key, o.priority, "
                     "greatest(0, extract(epoch FROM o.run_at - clock_timestamp()))::float8, "
                     "octet_length(o.body), extract(epoch FROM clock_timestamp() - a.first_at)::float8 "
                     f"FROM {t} o LEFT JOIN {a} a ON a.id = o.id "
                     "ORDER BY o.id LIMIT %s FOR UPDATE OF o SKIP LOCKED"),
            # Per key of the batch: is there an older row (blocked), and every row of the key
            # from our first to our last, ours or not (a gap cuts the key there).
            "keys": (f"SELECT EXISTS (SELECT 1 FROM {t} p WHERE p.queue = b.queue AND p.key = b.key "
                     f"AND p.id < b.lo), ARRAY(SELECT p.id FROM {t} p WHERE p.queue = b.queue "
                     "AND p.key = b.key AND p.id BETWEEN b.lo AND b.hi ORDER BY p.id) "
                     "FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bigint[]) "
                     "WITH ORDINALITY AS b(queue, key, lo, hi, n) ORDER BY b.n"),
            "bodies": f"SELECT id, body FROM {t} WHERE id = ANY(%s)",
            # RETURNING: the marks this batch made (only those may be dropped again)
            "attempt": (f"INSERT INTO {a} (id, first_at) SELECT unnest(%s::bigint[]), clock_timestamp() "
                        "ON CONFLICT (id) DO NOTHING RETURNING id"),
            "orphans": f"DELETE FROM {a} a WHERE NOT EXISTS (SELECT 1 FROM {t} o WHERE o.id = a.id)",
            "reject": (f"INSERT INTO {self.table.q('_rejected')} "
                       "(id, queue, key, body, priority, run_at, created_at, error) "
                       f"SELECT id, queue, key, body, priority, run_at, created_at, %s FROM {t} WHERE id = %s"),
            "delete": f"DELETE FROM {t} WHERE id = ANY(%s)",
            "forget": f"DELETE FROM {a} WHERE id = ANY(%s)",
            "notify": "SELECT pg_notify(%s, '')",
            "refuses": (f"INSERT INTO {self.table.q('_meta')} (name, value) VALUES ('refuses', %s) "
                        "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"),
        }

    # ------------------------------------------------------------------ public
    def stop(self) -> None:
        """Finish the batch under way, then return from :meth:`run`. Safe from any thread
        and from a signal handler (it sets a flag)."""
        self._stopping = True

    def run(self, until_idle: bool = False) -> RelayStats:
        """Relay until stopped (or, with ``until_idle``, until a batch finds nothing to
        move). A database or queue that fails is retried with backoff; a bad DSN at start
        and :class:`OutboxBehind` are raised. Returns a copy of the counters."""
        old = install_stop_signals(self.stop, "shardq outbox relay")
        backoff = 0.0
        try:
            self._connect()  # the first connection fails loudly: bad DSN, no server, no rights
            while not self._stopping:
                try:
                    if self._conns is None:
                        self._connect()
                    moved = self.relay_batch()
                    backoff = 0.0
                    if moved:
                        continue
                    if until_idle:
                        break
                    # Rows held back behind another relay's batch: that relay notifies when
                    # it commits; but our own brief locks may have made *it* skip rows, and
                    # an empty batch notifies nobody. Look again soon rather than at poll_s.
                    self._wait(HELD_RETRY_S if self._held else self._poll_s)
                except (StoreUnavailable, *RETRIED, pgconn.psycopg().OperationalError) as exc:
                    backoff = self._failed(exc, backoff)
        finally:
            restore_signals(old)
        return dataclasses.replace(self.stats)

    def relay_batch(self) -> int:
        """Move one batch; returns how many rows left the outbox (sent or rejected). A queue
        error (:data:`~.sending.RETRIED`) is raised once the rows the queue did take are
        deleted, and the marks of the rows it never took dropped, in a committed transaction."""
        conns = self._conns or self._connect()
        conn = conns.main
        if self._clock.monotonic() >= self._orphans_at:
            self._forget_orphans(conns)
        with conn.transaction():
            locked = [_Row(*r) for r in conn.execute(self._sql["lock"], (self._batch_rows,))]
            rows = self._in_key_order(conn, locked)
            self._held = len(locked) - len(rows)
            rows = self._cut_by_bytes(rows)
            if not rows:
                return 0
            self._check_window(rows)
            ids = [r.id for r in rows]
            bodies = dict(conn.execute(self._sql["bodies"], (ids,)).fetchall())
            # autocommit: durable before the send
            marked = {i for (i,) in conns.marks.execute(self._sql["attempt"], (ids,)).fetchall()}
            sent, rejected, unsent, error = self._send(rows, bodies)
            for row, text in rejected:
                conn.execute(self._sql["reject"], (text, row.id))
            gone = [r.id for r in sent] + [r.id for r, _ in rejected]
            # Never taken by the queue: not sent, so no mark of this batch's (an older one
            # stays: an earlier batch may have sent the row).
            forget = gone + [r.id for r in unsent if r.id in marked]
            if gone:
                conn.execute(self._sql["delete"], (gone,))
            if forget:
                conn.execute(self._sql["forget"], (forget,))
            if gone:
                conn.execute(self._sql["notify"], (channel(self.table),))  # rows behind ours may go now
        if gone:
            self.stats.batches += 1
        self.stats.moved += len(sent)
        self.stats.rejected += len(rejected)
        if error is not None:
            raise error
        return len(gone)

    def close(self) -> None:
        self._disconnect()

    # ------------------------------------------------------------------ one batch
    def _in_key_order(self, conn: Connection[Any], rows: list[_Row]) -> list[_Row]:
        """The rows that may go now: per key, the longest run, from the key's oldest row,
        of rows this batch holds with no row of the key between them."""
        by_key: dict[tuple[str, str], list[_Row]] = {}
        for r in rows:
            if r.key is not None:
                by_key.setdefault((r.queue, r.key), []).append(r)
        if not by_key:
            return rows
        groups = list(by_key.items())
        answers = conn.execute(self._sql["keys"], (
            [q for (q, _), _ in groups], [k for (_, k), _ in groups],
            [g[0].id for _, g in groups], [g[-1].id for _, g in groups])).fetchall()
        held: set[int] = set()
        for (_, group), (blocked, ids) in zip(groups, answers):
            if blocked:
                held.update(r.id for r in group)
                continue
            for i, r in enumerate(group):
                if i >= len(ids) or ids[i] != r.id:  # a row of this key we do not hold
                    held.update(x.id for x in group[i:])
                    break
        return [r for r in rows if r.id not in held]

    @staticmethod
    def _cut_by_bytes(rows: list[_Row]) -> list[_Row]:
        """A prefix (in row order, so per key too) of at most BATCH_BYTES_MAX body bytes."""
        total = 0
        for i, r in enumerate(rows):
            total += r.body_bytes
            if total > BATCH_BYTES_MAX and i > 0:
                return rows[:i]
        return rows

    def _check_window(self, rows: list[_Row]) -> None:
        again = [(r, r.attempted_ago) for r in rows if r.attempted_ago is not None]
        if not again:
            return
        self.stats.resent += len(again)
        log.warning("outbox %s: sending %d row(s) again, first sent up to %.1f s ago (a batch "
                    "did not finish); the queue deduplicates them", self.table, len(again),
                    max(ago for _, ago in again))
        windows = {queue: self._safe_window(queue) for queue in {r.queue for r, _ in again}}
        behind = [(r, ago, windows[r.queue]) for r, ago in again if ago > windows[r.queue]]
        if behind:
            r, ago, safe = behind[0]
            ids = ", ".join(str(b.id) for b, _, _ in behind[:10]) + (" ..." if len(behind) > 10 else "")
            raise OutboxBehind(
                f"outbox {self.table}: {len(behind)} row(s) (ids {ids}) were first sent to the queue "
                f"{ago:.0f} s ago, more than the {safe:.0f} s the queue's dedup window "
                f"(less a safety margin) covers; sending them again could enqueue duplicates. "
                f"Check whether jobs with dedup_id 'outbox:{self._scope}:<id>' were delivered, then "
                f"delete those rows from {self.table} (if they were) or their rows in "
                f"{self.table}_attempts (to send them again), and restart the relay.")

    def _safe_window(self, queue: str) -> float:
        """How old a first send may be for ``queue`` to still deduplicate it again: asked of
        the queue at every resend (rare), never kept, so a reload that lowers its
        ``dedup_window`` is seen (the client's own answer is at most
        ``QUEUE_CONFIG_MAX_AGE_S`` old)."""
        try:
            window = self._q.queue_config(queue).get("dedup_window")
        except UnknownQueue:
            return float("inf")  # the queue will reject the row; nothing can be duplicated
        if window is None:
            raise InvalidConfig(f"the queue backend reports no dedup_window for queue {queue!r}: "
                                "the outbox relay cannot resend safely")
        safe = float(window) - max(DEDUP_MARGIN_S, DEDUP_MARGIN_FRACTION * float(window))
        if safe < SAFE_WINDOW_S_MIN:
            raise InvalidConfig(
                f"queue {queue!r} has dedup_window {window} s; the outbox relay needs at least "
                f"{SAFE_WINDOW_S_MIN + DEDUP_MARGIN_S:.0f} s to resend without duplicates")
        return safe

    def _send(self, rows: list[_Row], bodies: dict[int, bytes]) -> _Sent:
        """:func:`~.sending.send` the rows: the rows the queue has, those it refused (with
        the error), those it never took, and the error that stopped the batch."""
        jobs = [{"body": bytes(bodies[r.id]), "key": r.key, "queue": r.queue, "delay": r.delay_s,
                 "priority": r.priority, "dedup_id": f"outbox:{self._scope}:{r.id}"} for r in rows]
        out = send(self._q, jobs)
        for i, exc in out.rejected:
            log.error("outbox %s: the queue refused row %d (%s); moved to %s_rejected",
                      self.table, rows[i].id, exc, self.table)
        if out.unsent:
            log.info("outbox %s: %d row(s) not sent (%s): not counted as sent", self.table,
                     len(out.unsent), type(out.error).__name__)
        return _Sent([rows[i] for i in out.sent], [(rows[i], error_text(exc)) for i, exc in out.rejected],
                     [rows[i] for i in out.unsent], out.error)

    def _forget_orphans(self, conns: _Conns) -> None:
        """Remove the attempt marks whose outbox row is gone: deleted by hand (the recovery
        from OutboxBehind), they would be counted by nothing and removed by nothing else."""
        self._orphans_at = self._clock.monotonic() + ORPHANS_S
        n = conns.marks.execute(self._sql["orphans"]).rowcount
        if n > 0:
            log.info("outbox %s: removed %d attempt mark(s) whose rows were deleted", self.table, n)

    # ------------------------------------------------------------------ connections, waiting
    def _connect(self) -> _Conns:
        self._disconnect()
        what = f"outbox relay ({self.table})"
        conns = []
        try:
            for _ in range(3):  # named, so pg_stat_activity shows which process holds what
                conns.append(pgconn.connect(self._dsn, what=what,
                                            application_name=f"shardq outbox relay pid={os.getpid()}"))
            conn, marks, listen = conns
            self._scope = install(conn, self.table)
            with conn.transaction():  # for outbox.enqueue: what this relay's queue refuses
                conn.execute(self._sql["refuses"], (f"{getattr(self._q, 'backend', 'shards')}:"
                                                     + ",".join(refused_fields(self._q)),))
            listen.execute(f'LISTEN "{channel(self.table)}"')
        except BaseException as exc:
            for c in conns:
                c.close()
            if pgconn.is_disconnect(exc):
                raise pgconn.unavailable(exc, what) from None
            raise
        self._conns = _Conns(conn, marks, listen)
        return self._conns

    def _disconnect(self) -> None:
        conns, self._conns = self._conns, None
        for c in conns or ():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass

    def _failed(self, exc: BaseException, backoff: float) -> float:
        self.stats.unavailable += 1
        if isinstance(exc, (StoreUnavailable, pgconn.psycopg().OperationalError)):
            self._disconnect()
        backoff = min(BACKOFF_S_MAX, max(BACKOFF_S_MIN, backoff * 2))
        log.warning("outbox %s: %s: %s; retrying in %.1f s", self.table, type(exc).__name__,
                    " ".join(str(exc).split()), backoff)
        self._sleep(backoff)
        return backoff

    def _sleep(self, seconds: float) -> None:
        deadline = self._clock.monotonic() + seconds
        while not self._stopping:
            left = deadline - self._clock.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, STOP_CHECK_S))

    def _wait(self, timeout: float) -> None:
        """Sleep until another session commits a NOTIFY on the channel, or ``timeout``."""
        conns = self._conns or self._connect()  # connected by the batch before
        own = conns.main.info.backend_pid
        deadline = self._clock.monotonic() + timeout
        self.waiting = True
        try:
            while not self._stopping:
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    return
                if any(n.pid != own for n in conns.listen.notifies(timeout=min(left, STOP_CHECK_S))):
                    break
            for _ in conns.listen.notifies(timeout=0):  # drained: the next batch sees those rows
                pass
        finally:
            self.waiting = False


def status(dsn: str, table: str = TABLE_DEFAULT) -> dict[str, Any]:
    """How far the outbox is behind: rows waiting, the oldest one's age, rows sent before
    (a relay died or failed mid-batch) and the oldest such attempt, rows rejected."""
    t = pgconn.TableName(table)
    with pgconn.connect(dsn, what=f"outbox ({table})") as conn:
        pending, oldest = pgconn.one_row(conn.execute(
            f"SELECT count(*), extract(epoch FROM clock_timestamp() - min(created_at))::float8 "
            f"FROM {t.q()}"))
        attempted, oldest_attempt = pgconn.one_row(conn.execute(  # of rows still there (see _forget_orphans)
            f"SELECT count(*), extract(epoch FROM clock_timestamp() - min(a.first_at))::float8 "
            f"FROM {t.q('_attempts')} a JOIN {t.q()} o ON o.id = a.id"))
        (rejected,) = pgconn.one_row(conn.execute(f"SELECT count(*) FROM {t.q('_rejected')}"))
    return {"table": table, "pending": pending, "oldest_s": oldest, "attempted": attempted,
            "oldest_attempt_s": oldest_attempt, "rejected": rejected}
