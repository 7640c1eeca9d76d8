"""A shard process: the thin I/O shell around :class:`~shardq.shard.durable.DurableShard`.

One loop iteration: wait until some connection is readable, read every ready request
frame, apply its requests to the state (those left when the iteration has worked
``SLICE_S``, first in the next), write the resulting log operations, make them
durable with **one** fsync, then send the replies. No reply to a request that changed
state leaves before that fsync, except a lease of a ``lease_sync = "batched"`` queue whose
job's enqueue is already durable: it leaves once its record is written (committer.py).
Replies that changed nothing (reads, errors) leave at once.

Clients connect to a unix socket and authenticate with the HMAC challenge of
``multiprocessing.connection`` (done on a side thread with a timeout, so a silent client
cannot stall the loop). Clients send msgpack frames with ``send_bytes``; the shard reads
that framing without blocking (:mod:`.conn`) and never unpickles. A client that sends an
undecodable or oversized frame is disconnected; a well-formed request that is invalid gets
an error reply. Neither touches the log or the other clients.

Run by the supervisor as ``python -m shardq.shard.process --data-dir D --index I --config-file F``,
in a session of its own (a Ctrl-C meant for the supervisor's terminal or embedding app
does not reach it). It tells the supervisor how it is doing on its stdout (:mod:`.report`).
SIGTERM: the loop finishes its iteration and serves the requests it had read (no request
is read after it, so no lease is handed out), the committer fsyncs and sends every reply,
and the shard writes a checkpoint if this run logged enough (STOP_CHECKPOINT_SHARE,
STOP_CHECKPOINT_MIN_BYTES), so the next start replays it, not the records. It then exits
without tearing down the interpreter (os._exit: freeing a million jobs one by one takes seconds).
Exit codes: 0 stopped cleanly, 3 corrupt log, 4 log write failed or log cannot be opened
(disk full, I/O error), 70 internal error.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import gc
import json
import logging
import math
import os
import resource
import select
import signal
import socket
import sys
from collections import deque
from itertools import zip_longest
from contextlib import AbstractContextManager, contextmanager, nullcontext
from collections.abc import Callable, Collection, Iterator
from enum import Enum
from typing import Any, Final, NotRequired, TypeAlias, TypedDict

from .. import limits
from ..busypoll import BusyPoll
from .acceptor import SERVICE_CONNECTIONS_MAX, Acceptor, ConnectionSlots
from ..clock import Clock, SystemClock
from ..config import Config, check_queue_name, parse as parse_config
from ..datadir import DataDir
from ..errors import (CorruptLog, InvalidJob, InvariantViolation, LogFailed, ProtocolError, QueueFull,
                      ShardqError)
from ..protocol import wire as protocol
from ..stopping import die_with_parent
from . import boot_fence
from .boot_fence import VISIBILITY_EPS_S
from .committer import Committer, Send
from .calls import handlers
from .control_handlers import ControlHandlers, Handler
from .conn import FRAME_COMPLETE_S, UNREAD_BYTES_MAX, FrameConn
from .durable import DurableShard
from .jobstate import R
from .ops import new
from .histogram import Snapshot
from .queues import QueueStats
from .report import NO_SPACE, RELOAD, RELOAD_FILE, ReportingFiles, SupervisorPipe
from .result_handlers import ResultHandlers
from .results import WorkflowStats
from .state import ShardState

log = logging.getLogger("shardq.shard")

EXIT_OK, EXIT_CORRUPT, EXIT_LOG_FAILED, EXIT_BUG = 0, 3, 4, 70
INLINE_REQUESTS_MAX = 2      # an iteration this small commits on the loop thread (latency)
MARK_RETRY_S = 0.001         # an idle loop whose sync mark must wait looks again this soon
#: An iteration serves frames until it has worked SLICE_S; the frames left (a frame of more
#: than SLICE_REQUESTS requests counts as several) are served by the next, before anything
#: read then: a crowd of clients or one frame of many requests cannot hold the loop (and its
#: health pings, lease expiries and other clients) for seconds
SLICE_S = 0.1
SLICE_REQUESTS = 256
#: A stopping shard writes a checkpoint if the log since the last one is at least this
#: share of the checkpoint's size, and at least STOP_CHECKPOINT_MIN_BYTES. A rule of thumb:
#: writing a checkpoint takes about as long as replaying it, so one that replaces fewer
#: records would lengthen the stop more than it shortens the next start; and a mebibyte
#: of records replays in milliseconds. docs/operations.md, "Signals".
STOP_CHECKPOINT_SHARE = 0.5
STOP_CHECKPOINT_MIN_BYTES = 1 << 20
_SHARD_BITS = limits.JOB_ID_SHARD_BITS
_ARITY, _OK = protocol.ARITY, protocol.OK
read_frames, decode_requests = protocol.read_frames, protocol.decode_requests
_FRAME_BYTES_MAX = limits.FRAME_BYTES_MAX


class _Deferred(Enum):
    """The type of :data:`_DEFERRED`: an enum, so that ``reply is _DEFERRED`` narrows a reply's type."""
    DEFERRED = 0


#: What a handler returns for a request it answers later (watch, dequeue_wait): no reply now.
_DEFERRED: Final = _Deferred.DEFERRED
#: A reply: [request id, protocol.OK or protocol.ERR, what it carries].
Reply: TypeAlias = list[Any]
Batch: TypeAlias = tuple[FrameConn, list[list[Any]]]  # a connection and requests of one frame, decoded
#: A waiting watch: (conn, request id, deadline_monotonic).
Watcher: TypeAlias = tuple[FrameConn, int, float]
#: A waiting dequeue: (conn, request id, visibility, max_jobs, deadline_monotonic); visibility
#: and max_jobs as the client sent them (the state validates them at each try).
LeaseWaiter: TypeAlias = tuple[FrameConn, int, Any, Any, float]


class ShardStats(TypedDict):
    """The reply to ``stats``; ``metrics`` adds the last five (control_handlers.py)."""
    shard: int
    pid: int
    queues: dict[str, QueueStats]
    jobs: int
    wal_bytes: int
    wal_disk_bytes: int
    segments: int
    compactions: int
    clients: int
    clients_max: int
    clients_turned_away: int
    service_connections: int
    iterations: int
    waiting_dequeues: int
    replay_records: int
    replay_seconds: float
    compaction_deferred: str | None  # why compaction is put off (no space for a checkpoint), or None
    results: int                     # results kept (results.py)
    barriers: dict[str, int]         # {"open": n, "fired": n, "cancelled": n}
    workflows: dict[str, int]        # records kept: {"running": n, "succeeded": n, "failed": n, "cancelled": n}
    placed: list[str]                # the config's limited queues (state.placed_queues: queue_totals)
    queue_metrics: NotRequired[dict[str, dict[str, float | None]]]
    workflow_counters: NotRequired[dict[str, int]]   # results.py, since the shard started
    commit_seconds: NotRequired[Snapshot]
    commit_ops: NotRequired[Snapshot]
    fsyncs: NotRequired[int]


class ShardServer(ControlHandlers, ResultHandlers):
    """Serves one :class:`DurableShard` on a unix socket until :meth:`stop`. Each op is
    served as ``wire.REQUESTS`` says (:func:`.calls.handlers`): by the one generic handler,
    which calls the state method it names, or by the method it names here (the control
    ops': ControlHandlers; arrive_many: ResultHandlers)."""

    def __init__(self, shard: DurableShard, sock_path: str, authkey: bytes, clock: Clock | None = None,
                 busy: Callable[[str], AbstractContextManager[object]] | None = None,
                 health: tuple[int, Callable[[bytes], None]] | None = None):
        self.shard = shard
        #: busy(phase): a context manager telling the supervisor that the loop is working,
        #: not hung, while it cannot answer pings (compaction); see :mod:`.report`
        self.busy = busy or (lambda phase: nullcontext())
        #: (fd, answer): the supervisor's health pings arrive as bytes on fd (the shard's
        #: stdin pipe); the loop answers each read with answer(bytes read), proving it
        #: iterates (the bytes: report.PING, report.RELOAD)
        self._health_fd: int
        self._answer_health: Callable[[bytes], None] | None
        self._health_fd, self._answer_health = health if health else (-1, None)
        self.state = shard.state
        self.sock_path = sock_path
        self.authkey = authkey
        self.clock = clock or SystemClock()
        #: the loop's own waits (busy polling) are timed in real time, whatever clock it serves by
        self._real = SystemClock()
        self._mono = self._real.monotonic  # (bound once: read twice an iteration)
        self.conns: set[FrameConn] = set()
        #: per role (sockio.ROLES): a slot per connection, taken by the acceptor, given
        #: back by _drop
        self.slots = {"client": ConnectionSlots(shard.config.limits.max_connections),
                      "service": ConnectionSlots(SERVICE_CONNECTIONS_MAX)}
        self.incoming: deque[FrameConn] = deque()
        self._poller = select.epoll()              # the wake pipe and every client
        self._busy = BusyPoll(shard.config.service.busy_poll_us, self._real)  # how the loop waits (iterate)
        #: the last iteration sent a reply to a connection of role "client": its next request
        #: may come a round trip later, the only wait worth polling for (a parked
        #: dequeue_wait, a health ping or a lease expiry answers nobody, and a "service"
        #: connection, serve's own or the SQS listener's, never polls for its reply, so its
        #: next request comes late: nothing comes back soon)
        self._answered = True
        self._by_fd: dict[int, FrameConn] = {}     # client connections, by descriptor
        self._closes: list[FrameConn] = []
        self._backlog: list[Batch] = []  # requests read, to serve first (iterate)
        self._begun: set[FrameConn] = set()  # clients part of whose next frame came (conn.FRAME_COMPLETE_S)
        #: the pipelined committer, started by serve() before the loop runs (a driver of
        #: iterate() without serve() sets one first: bench/probes/shard_path.py). The loop's
        #: methods use it unchecked: their ``# type: ignore[union-attr]`` says so.
        self.committer: Committer | None = None
        self.watchers: dict[str, list[Watcher]] = {}    # queue -> [(conn, rid, deadline_monotonic)]
        #: queue -> [(conn, rid, visibility, max_jobs, deadline_monotonic)]: waiting dequeues,
        #: oldest first (dequeue_wait)
        self.lease_waiters: dict[str, list[LeaseWaiter]] = {}
        self.stopping = False
        self._early_lease = False  # set by _dequeue: this lease may leave before its fsync
        #: a placed queue's lease of at most this visibility may leave before its fsync: the
        #: next start fences placed queues if a power cut may have lost it (boot_fence.py);
        #: 0 (no boot record: a shard run without main()) fsyncs every placed lease first
        self.early_placed_s = 0.0
        self.iterations = 0
        self._scratch = bytearray(protocol.READ_BYTES)  # every read lands here first (wire.read_frames)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: op -> handler(args, now, conn, rid), derived from the one table of ops
        self._handlers: dict[str, Handler] = handlers(self)

    # ------------------------------------------------------------------ lifecycle
    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already awake

    def stop(self) -> None:
        """Finish the current iteration (its fsync and replies), then return from serve()."""
        self.stopping = True
        self.wake()

    def _deliver(self, conn: FrameConn) -> None:
        self.incoming.append(conn)
        self.wake()

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        if os.path.exists(self.sock_path):
            os.unlink(self.sock_path)  # left by a crashed predecessor; we hold the shard lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.sock_path)
        finally:
            os.umask(old_umask)
        listener.listen(128)
        self._poller.register(self._wake_r, select.EPOLLIN)
        if self._health_fd >= 0:
            self._poller.register(self._health_fd, select.EPOLLIN)
        self.committer = Committer(self.shard.log, EXIT_LOG_FAILED)
        self.committer.durable_seq = self.state.next_seq - 1  # everything replayed is durable
        Acceptor(listener, self.authkey, self._deliver, self.clock, self.slots).start()
        if on_ready:
            on_ready()
        try:
            while not self.stopping or self._backlog:  # what was read is served
                self.iterate()
        finally:
            listener.close()
            try:
                os.unlink(self.sock_path)
            except FileNotFoundError:
                pass
            self.committer.submit([], [], list(self.conns) + self._closes)
            self.committer.stop()
            self._poller.close()

    # ------------------------------------------------------------------ the loop
    def _timeout(self) -> float | None:
        """How long the loop may wait for its next event: the next sync due, a waiter's
        deadline, the state's next deadline; None (block until a client speaks: no CPU while
        idle) if there is none, which :meth:`iterate` tests before it calls this."""
        sync_due = self.committer.sync_due_at  # type: ignore[union-attr]  # the loop runs: it is set
        waiting = self.watchers or self.lease_waiters
        if not waiting and sync_due is None and not self._begun:
            return None
        mono = self.clock.monotonic()
        t = math.inf if sync_due is None else sync_due - mono
        if self._begun:
            t = min(t, min(c.begun_at for c in self._begun) + FRAME_COMPLETE_S - self._mono())
        if waiting:
            if self.watchers:
                t = min(t, min(w[2] for ws in self.watchers.values() for w in ws) - mono)
            for ws in self.lease_waiters.values():  # (usually one queue's: no generator)
                for w in ws:
                    if w[4] - mono < t:
                        t = w[4] - mono
            due = self.state.next_deadline()
            if due is not None:
                t = min(t, due - self.clock.now())
        return max(t, 0.0)

    def iterate(self) -> None:
        """One iteration: read what is ready, apply, then hand the log payload and the
        replies to the committer (which fsyncs before it sends them)."""
        committer = self.committer
        # (_timeout's idle case tested here: no sync due and no waiter, the usual iteration)
        timeout = (None if committer.sync_due_at is None  # type: ignore[union-attr]  # the loop runs: it is set
                   and not self.watchers and not self.lease_waiters and not self._begun else self._timeout())
        held: Collection[FrameConn]  # clients not read in this iteration
        events: list[tuple[int, int]] | None
        if self._backlog:  # requests read and not served yet come first; nothing waits meanwhile
            batches, held, events = self._from_backlog()
        else:
            batches, held = [], ()  # (conn, its decoded requests)
            busy = self._busy
            waited_from = self._mono()
            # a lone client's next request comes a round trip after our reply: poll for it
            # before sleeping, while such waits have been short (shardq/busypoll.py); after an
            # iteration that answered nobody, no request is a round trip away: sleep at once
            events = busy.spin_if_wanted(self._poller.poll, timeout) if timeout != 0 and self._answered else None
            if not events:
                if (timeout is None and self.shard.log.mark_pending
                        and not committer.write_mark()):  # type: ignore[union-attr]  # the loop runs: it is set
                    timeout = MARK_RETRY_S  # a sync or the committer thread is still at it: mark after
                # epoll takes milliseconds: round up, or a sub-millisecond deadline spins at 0
                events = self._poller.poll(-1 if timeout is None else math.ceil(timeout * 1e3) / 1e3)
            busy.note(self._mono() - waited_from)
        conn: FrameConn | None
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                while self.incoming:  # each holds a slot (the acceptor took it)
                    conn = self.incoming.popleft()
                    self.conns.add(conn)
                    self._by_fd[conn.fd] = conn
                    self._poller.register(conn.fd, select.EPOLLIN)
            else:
                conn = self._by_fd.get(fd)
                if conn is not None and conn not in held:  # None: dropped earlier in this iteration
                    self._read(conn, batches)
                elif fd == self._health_fd:
                    self._health_ping()
        if self._begun:
            self._drop_unfinished()
        self.iterations += 1
        now = self.clock.now()
        state = self.state
        state.advance(now)
        # A reply is "late" (sent after the fsync of this iteration's records) if its request
        # changed the state; "early" otherwise, or for a lease that may go before its record
        # is durable (_dequeue decides). See committer.py.
        late: dict[FrameConn, list[Reply]] = {}
        early: dict[FrameConn, list[Reply]] = {}
        pending = state._ops
        n_requests = 0
        work_end = self._mono() + SLICE_S if len(batches) > 1 else 0.0
        for b, (conn, requests) in enumerate(batches):
            if b and self._mono() > work_end:  # (a lone frame, the usual case, reads no clock)
                self._backlog = _turns(batches[b:], batches[b - 1][0], self.conns)
                break
            n_requests += len(requests)
            for rid, op, args in requests:
                before = len(pending)
                self._early_lease = False
                reply = self._execute(conn, rid, op, args, now, before)
                if reply is _DEFERRED:
                    continue
                if len(pending) == before or self._early_lease:
                    early.setdefault(conn, []).append(reply)
                else:
                    late.setdefault(conn, []).append(reply)
        if self.lease_waiters:
            self._serve_lease_waiters(now, early, late)
        if self.watchers:
            self._notify_watchers(early)
        if late or state.sync_forced:
            sync = True
        else:  # written, unsynced records (batched leases) have waited their longest?
            due = committer.sync_due_at  # type: ignore[union-attr]  # the loop runs: it is set
            sync = due is not None and self.clock.monotonic() >= due
        if state.sync_forced:  # a new token epoch: nothing of this iteration leaves before it
            for conn, out in early.items():
                late.setdefault(conn, []).extend(out)
            early = {}
            state.sync_forced = False
        self._answered = False  # until _frames frames a reply to a "client" connection
        closes = self._closes
        if closes:
            self._closes = []
        n_ops = len(state._ops)  # one log operation each (the fdatasync's metrics count them)
        committer.submit(  # type: ignore[union-attr]  # the loop runs: it is set
            self.shard.take_payloads(), self._frames(late) if late else [], closes,
            inline=n_requests <= INLINE_REQUESTS_MAX,
            early=self._frames(early) if early else [], sync=sync, seq=state.next_seq - 1, ops=n_ops)
        if self.shard.compaction_due():
            # the checkpoint must follow every record before it
            self.committer.drain()  # type: ignore[union-attr]  # the loop runs: it is set
            with self.busy("compact"):  # pings wait meanwhile: tell the supervisor we live
                self.shard.compact()  # for want of space it does not, and the shard goes on
            # a compaction that found no space opened the log again (DurableShard._put_log_back)
            self.committer.log = self.shard.log  # type: ignore[union-attr]  # the loop runs: it is set

    def _from_backlog(self) -> tuple[list[Batch], set[FrameConn], list[tuple[int, int]]]:
        """The requests an earlier iteration read and left after its ``SLICE_S``, to serve
        first (a dropped client's left out), their clients, not read again until they are
        served, and what is ready now (nothing once stopping: no request is read after it)."""
        batches = [b for b in self._backlog if b[0] in self.conns]
        self._backlog = []
        return batches, {c for c, _ in batches}, [] if self.stopping else self._poller.poll(0)

    def _health_ping(self) -> None:
        try:
            got = os.read(self._health_fd, 4096)
        except BlockingIOError:
            return
        if got:
            if self._answer_health is not None:  # (always: it comes with the fd)
                self._answer_health(got)
        else:  # the supervisor is gone (its PDEATHSIG ends us): stop watching the pipe
            self._poller.unregister(self._health_fd)
            self._health_fd = -1

    def _frames(self, replies: dict[FrameConn, list[Reply]]) -> list[Send]:
        """The frames of each connection's replies; sets ``_answered`` if one goes to a
        connection of role "client" (one that polls for its replies: the loop polls for its
        next request, :meth:`iterate`)."""
        conns, pack, frames = self.conns, protocol.pack, []
        for conn, out in replies.items():
            if conn in conns:
                if conn.role == "client":
                    self._answered = True
                data = pack(out)  # one frame, unless together the replies pass the limit
                if len(data) <= _FRAME_BYTES_MAX or len(out) == 1:
                    frames.append((conn, data))
                else:
                    frames.extend((conn, frame) for frame in _reply_frames(out))
        return frames

    def _read(self, conn: FrameConn, batches: list[Batch]) -> None:
        """Every complete frame the client has sent; one read per readiness event, so a
        busy client cannot starve the rest and a stalled one cannot block the loop. One that
        leaves more than ``UNREAD_BYTES_MAX`` of replies unread is dropped, not read."""
        if conn.out_bytes > UNREAD_BYTES_MAX:
            self._drop(conn, f"client left {conn.out_bytes} bytes of replies unread (at most {UNREAD_BYTES_MAX})")
            return
        try:  # (conn.read_frames written out: it runs on every readiness event)
            frames = read_frames(conn.fd, conn.buf, self._scratch)
            for data in frames:
                requests = decode_requests(data)
                if len(requests) <= SLICE_REQUESTS:
                    batches.append((conn, requests))
                else:  # served in slices, the loop's clock read between them (iterate)
                    batches.extend((conn, requests[i:i + SLICE_REQUESTS])
                                   for i in range(0, len(requests), SLICE_REQUESTS))
            if conn.buf:  # part of a frame: begun now, unless it is the one begun before
                if frames or not conn.begun_at:
                    conn.begun_at = self._mono()
                    self._begun.add(conn)
            elif conn.begun_at:
                conn.begun_at = 0.0
                self._begun.discard(conn)
        except BlockingIOError:
            pass  # nothing to read after all
        except ProtocolError as e:
            self._drop(conn, str(e))
        except (EOFError, OSError) as e:
            self._drop(conn, None if isinstance(e, EOFError) else f"read failed: {e}")

    def _drop_unfinished(self) -> None:
        """Drop each client that began a frame :data:`~.conn.FRAME_COMPLETE_S` ago and has
        not sent the rest."""
        now = self._mono()
        for conn in [c for c in self._begun if now - c.begun_at >= FRAME_COMPLETE_S]:
            self._drop(conn, f"client began a frame ({len(conn.buf)} bytes of it came) and did not send "
                             f"the rest within {FRAME_COMPLETE_S:g} s")

    def _drop(self, conn: FrameConn, why: str | None) -> None:
        if why:
            log.warning("dropping client: %s", why)
        self._begun.discard(conn)
        if conn in self.conns:
            self.conns.discard(conn)
            del self._by_fd[conn.fd]
            self._poller.unregister(conn.fd)
            self._closes.append(conn)  # closed by the committer, after replies queued before
            if conn.slots is not None:
                conn.slots.give_back()
        for ws in self.watchers.values():
            ws[:] = [w for w in ws if w[0] is not conn]
        for lws in self.lease_waiters.values():
            lws[:] = [w for w in lws if w[0] is not conn]
        conn.parked = 0

    def _execute(self, conn: FrameConn, rid: int, op: str, args: Any, now: float,
                 ops_before: int) -> Reply | _Deferred:
        """One request's reply. No request ends the shard but a broken invariant: an
        ``OSError`` of a handler's own I/O (``stats`` lists the log directory, which fails
        with EMFILE when descriptors run out) answers ``ShardUnavailable`` and the shard
        goes on. A failed log write is not one of these: the log raises ``LogFailed``,
        from the committer, which stops the shard (exit 4) as before. ``ops_before``: how
        many operations the state held for the log before this request."""
        try:
            handler = self._handlers.get(op)
            if handler is None or type(args) is not list or len(args) != _ARITY[op]:
                protocol.check_request(op, args)  # raises the precise error
            result = handler(args, now, conn, rid)  # type: ignore[misc]  # not None: check_request raised
            return result if result is _DEFERRED else [rid, _OK, result]
        except InvariantViolation:
            raise
        except ShardqError as e:
            return [rid, protocol.ERR, protocol.error_payload(e)]
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # A shape the validators did not foresee: the request is bad, not the shard.
            return [rid, protocol.ERR, ["ProtocolError", f"{op}: malformed arguments ({type(e).__name__})"]]
        except OSError as e:
            if len(self.state._ops) != ops_before:
                raise  # half applied: only a restart and a replay make the state whole again
            log.warning("%s failed, answered with an error: %s", op, e)
            return [rid, protocol.ERR, ["ShardUnavailable",
                                        f"shard {self.shard.shard_index} could not answer {op}: {e}"]]

    # ------------------------------------------------------------------ handlers
    def _enqueue(self, args: protocol.EnqueueArgs, now: float, conn: FrameConn, rid: int) -> list[int]:
        if type(args.items) is not list:
            raise InvalidJob("enqueue: items must be an array")
        return self.state.enqueue_many(args.items, now, args.session)  # which checks the session

    def _dequeue(self, args: protocol.DequeueArgs, now: float, conn: FrameConn, rid: int) -> list[protocol.LeaseRow]:
        queue, visibility, max_jobs = args.queue, args.visibility, args.max_jobs
        state = self.state
        leases = state.dequeue(queue, now, visibility, max_jobs)
        if not leases:
            return []
        q = state.queues[queue]
        # A placed queue's lease leaves before its fsync only if the boot record covers it:
        # one lost by a machine crash leaves its job running uncounted, so the next start
        # fences the queue until it has run out (docs/limits.md); a longer one waits.
        if q.cfg.lease_sync == "batched" and (
                q.lim is None or all(l.deadline - now <= self.early_placed_s + VISIBILITY_EPS_S
                                     for l in leases)):
            # The lease may leave before its record is durable, but never before the job's
            # enqueue is: a job a crash could lose must not reach a handler.
            durable = self.committer.durable_seq  # type: ignore[union-attr]  # the loop runs: it is set
            # (each ``type: ignore`` on a lease's job_id below: this shard's ids are ints; the
            # Lease type also allows the str ids of other backends, types.JobId)
            early = True
            for l in leases:  # (not all(): a generator costs more than the usual one lease)
                if l.job_id >> _SHARD_BITS > durable:  # type: ignore[operator]  # int ids here
                    early = False
                    break
            self._early_lease = early
        jobs, prioritized = state.jobs, q.prioritized
        row = protocol.LeaseRow
        return [new(row, (l.job_id, l.key, l.body, l.attempt, l.token, l.deadline,
                          jobs[l.job_id].priority, prioritized))  # type: ignore[index]  # int ids here
                for l in leases]

    def _dequeue_wait(self, args: protocol.DequeueWaitArgs, now: float, conn: FrameConn,
                      rid: int) -> list[protocol.LeaseRow] | _Deferred:
        """A dequeue that waits in the shard, up to ``wait_s``, for a job to lease. Served
        oldest first as jobs become ready (:meth:`_serve_lease_waiters`); [] at its deadline."""
        queue, visibility, max_jobs, wait_s = args.queue, args.visibility, args.max_jobs, args.wait_s
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s):
            raise InvalidJob("dequeue_wait: wait_s must be a finite number of seconds")
        rows = self._dequeue(protocol.DequeueArgs(queue, visibility, max_jobs), now, conn, rid)
        if rows or wait_s <= 0:
            return rows
        deadline = self.clock.monotonic() + min(float(wait_s), limits.WAIT_S_MAX)
        _park(conn)
        self.lease_waiters.setdefault(queue, []).append((conn, rid, visibility, max_jobs, deadline))
        return _DEFERRED

    def _cancel_wait(self, args: protocol.CancelWaitArgs, now: float, conn: FrameConn, rid: int) -> bool:
        """Withdraw this connection's waiting dequeue ``args.request_id``. True if it
        was still waiting (it will get no reply); False if it was already answered."""
        wanted = args.request_id
        for queue, ws in self.lease_waiters.items():
            for i, w in enumerate(ws):
                if w[0] is conn and w[1] == wanted:
                    del ws[i]
                    conn.parked -= 1
                    if not ws:
                        del self.lease_waiters[queue]
                    return True
        return False

    def _serve_lease_waiters(self, now: float, early: dict[FrameConn, list[Reply]],
                             late: dict[FrameConn, list[Reply]]) -> None:
        """Lease ready jobs to waiting dequeues, oldest first, and answer those whose wait
        is over with []. A lease is answered as a dequeue's would be: before the fsync only
        if its queue's leases are batched and its jobs are durable, else after it, in the
        same commit as the enqueue that made the job ready."""
        mono = self.clock.monotonic()
        state = self.state
        for queue in list(self.lease_waiters):
            ws = self.lease_waiters[queue]
            while ws and state.has_ready(queue):
                conn, rid, visibility, max_jobs, _ = ws[0]
                self._early_lease = False
                reply: Reply = self._execute(  # type: ignore[assignment]  # a dequeue is never _DEFERRED
                    conn, rid, "dequeue", [queue, visibility, max_jobs], now, len(state._ops))
                if reply[1] == _OK and not reply[2]:
                    break  # ready jobs it may not take (their keys are leased): wait on
                del ws[0]
                conn.parked -= 1
                (early if self._early_lease or reply[1] != _OK else late).setdefault(conn, []).append(reply)
            keep = []
            for w in ws:
                if w[4] <= mono:
                    early.setdefault(w[0], []).append([w[1], _OK, []])
                    w[0].parked -= 1
                else:
                    keep.append(w)
            if keep:
                ws[:] = keep
            else:
                del self.lease_waiters[queue]

    def _peek(self, args: protocol.PeekArgs, now: float, conn: FrameConn, rid: int) -> list[list[int]]:
        self.state.advance(now)
        return self.state.ready_priorities(args.queue, args.max_jobs)

    def _ack(self, args: protocol.AckArgs, now: float, conn: FrameConn, rid: int) -> list[list[str] | None]:
        pairs = args.pairs
        if type(pairs) is not list or len(pairs) > limits.BATCH_JOBS_MAX:
            raise InvalidJob(f"ack: expected at most {limits.BATCH_JOBS_MAX} [job_id, token] pairs")
        out: list[list[str] | None] = []   # per pair: None, or the error (protocol.error_payload)
        for pair in pairs:
            try:
                if type(pair) is not list or len(pair) != 2:
                    raise InvalidJob("ack: each item is [job_id, token]")
                self.state.ack(pair[0], pair[1], now)
                out.append(None)
            except ShardqError as e:
                if isinstance(e, InvariantViolation):
                    raise
                out.append(protocol.error_payload(e))
        return out

    def _nack(self, args: protocol.NackArgs, now: float, conn: FrameConn, rid: int) -> None:
        if type(args.delivered) is not bool:
            raise InvalidJob("nack: delivered must be true or false")
        self.state.nack(args.job_id, args.token, now, args.delay or 0, args.error, args.delivered)

    def _watch(self, args: protocol.WatchArgs, now: float, conn: FrameConn, rid: int) -> bool | _Deferred:
        queue, timeout = args.queue, args.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
            raise InvalidJob("watch: expects [queue, timeout_s] with a finite timeout")
        check_queue_name(queue, InvalidJob)  # (a parked watch holds its name: as dequeue's, 128 bytes)
        if self.state.has_ready(queue):
            return True
        timeout = min(max(float(timeout), 0.0), limits.WAIT_S_MAX)
        _park(conn)
        self.watchers.setdefault(queue, []).append((conn, rid, self.clock.monotonic() + timeout))
        return _DEFERRED

    def _notify_watchers(self, replies: dict[FrameConn, list[Reply]]) -> None:
        if not self.watchers:
            return
        mono = self.clock.monotonic()
        for queue in list(self.watchers):
            ws = self.watchers[queue]
            if self.state.has_ready(queue):
                for conn, rid, _ in ws:
                    replies.setdefault(conn, []).append([rid, protocol.OK, True])
                    conn.parked -= 1
                ws.clear()
            else:
                keep = []
                for w in ws:
                    if w[2] <= mono:
                        replies.setdefault(w[0], []).append([w[1], protocol.OK, False])
                        w[0].parked -= 1
                    else:
                        keep.append(w)
                ws[:] = keep
            if not ws:
                del self.watchers[queue]

    def _dead_letters(self, args: protocol.DeadLettersArgs, now: float, conn: FrameConn,
                      rid: int) -> list[protocol.DeadRow]:
        queue, limit = args.queue, args.limit
        limit = 1000 if limit is None else limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidJob("dead_letters: limit must be a non-negative integer")
        # (this shard's job ids are ints; the DeadLetter type also allows str ids, types.JobId)
        return [protocol.DeadRow(d.job_id, d.key, d.body, d.attempts, d.error)  # type: ignore[arg-type]  # int ids here
                for d in self.state.dead_letters(queue, min(limit, limits.BATCH_JOBS_MAX))]

    def _redrive(self, args: protocol.RedriveArgs, now: float, conn: FrameConn, rid: int) -> int:
        queue, job_ids = args.queue, args.job_ids
        if job_ids is not None and type(job_ids) is not list:
            raise InvalidJob("redrive: job_ids must be an array or null")
        return self.state.redrive(queue, now, job_ids)

    def _stats(self, args: protocol.NoArgs, now: float, conn: FrameConn, rid: int) -> ShardStats:
        lg = self.shard.log
        kept: WorkflowStats = self.state.workflow_stats()  # as of this iteration's advance
        return {"shard": self.shard.shard_index, "pid": os.getpid(), "queues": self.state.stats(),
                "jobs": len(self.state.jobs), "wal_bytes": lg.disk_bytes, "wal_disk_bytes": lg.allocated_bytes(),
                "segments": len(lg.segments),
                "compactions": self.shard.compactions, "clients": self.slots["client"].held,
                "clients_max": self.slots["client"].limit,
                "clients_turned_away": self.slots["client"].turned_away,
                "service_connections": self.slots["service"].held,
                "iterations": self.iterations,
                "waiting_dequeues": sum(map(len, self.lease_waiters.values())),
                "replay_records": self.shard.replay_stats.records if self.shard.replay_stats else 0,
                "replay_seconds": self.shard.replay_stats.seconds if self.shard.replay_stats else 0.0,
                "compaction_deferred": self.shard.compaction_deferred,
                "results": kept["results"], "barriers": kept["barriers"],
                "workflows": self.state.workflow_states(), "placed": self.state.placed_queues()}

    def _ping(self, args: protocol.NoArgs, now: float, conn: FrameConn, rid: int) -> int:
        return os.getpid()


def _park(conn: FrameConn) -> None:
    """Count a waiting dequeue or watch ``conn`` parks; QueueFull (nothing parked) past
    :data:`~shardq.limits.PARKED_WAITS_MAX` of its own at once."""
    if conn.parked >= limits.PARKED_WAITS_MAX:
        raise QueueFull(f"this connection has {conn.parked} waiting dequeues and watches parked in the shard, "
                        f"the most one may (limits.PARKED_WAITS_MAX); wait for some to be answered")
    conn.parked += 1


def _turns(left: list[Batch], served: FrameConn, conns: set[FrameConn]) -> list[Batch]:
    """The batches an iteration left, in the order the next serves them: one of each
    connection in turn, each connection's in their order, the one served last going last
    (a frame of many requests cannot keep the others waiting for all of it); a dropped
    client's are not served."""
    by_conn: dict[FrameConn, list[Batch]] = {}
    for batch in left:
        if batch[0] in conns:
            by_conn.setdefault(batch[0], []).append(batch)
    if served in by_conn:
        by_conn[served] = by_conn.pop(served)
    return [batch for turn in zip_longest(*by_conn.values()) for batch in turn if batch is not None]


def _reply_frames(replies: list[Reply]) -> list[bytes]:
    """One frame for a connection's replies of one iteration, or several when together they
    pass the frame limit (each reply alone fits: leases and dead letters are cut to
    ``limits.REPLY_BYTES_MAX``); a client refuses frames over the limit."""
    data = protocol.pack(replies)
    if len(data) <= limits.FRAME_BYTES_MAX or len(replies) == 1:
        return [data]
    frames: list[bytes]
    parts: list[bytes]
    frames, parts, size = [], [], 0
    for reply in replies:
        one = protocol.pack(reply)
        if parts and size + len(one) + 5 > limits.FRAME_BYTES_MAX:
            frames.append(protocol.pack_array(parts))
            parts, size = [], 0
        parts.append(one)
        size += len(one)
    frames.append(protocol.pack_array(parts))
    return frames


#: Young objects (net allocations of containers) between two collections. A collection's
#: pause grows with what it scans: about 0.6 ms at this many on the 2-CPU VMs measured
#: (6.4 ms at the 50,000 of before; docs/performance.md, "The shard's collections").
GC_YOUNG_MAX = 5_000


def tune_gc() -> None:
    """Jobs form no garbage cycles (refcounting frees them), yet the cyclic GC would scan
    every live job on each full collection: with a million jobs that is a pause of about a
    second. Move what replay built out of the GC's view, and after every collection move its
    survivors out too (:func:`_freeze_survivors`): a collection then scans only the objects
    made since the last one, at most about ``GC_YOUNG_MAX``, and never the state. Nothing a
    request makes forms a cycle (measured: no cyclic garbage over 10,000 requests of every
    kind, errors included); one that did and outlived a collection would stay allocated."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_MAX, 50, 1000)
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def untune_gc() -> None:
    """Undo :func:`tune_gc` in a process that goes on after its shard (a test, a probe
    driving the loop in process): the default thresholds, no freezing after collections,
    and what was frozen back in the GC's view."""
    if _freeze_survivors in gc.callbacks:
        gc.callbacks.remove(_freeze_survivors)
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """After a collection, what survived it is long-lived (jobs, mostly): out of the GC's
    view, so that no older generation grows and a later collection never rescans it. (Before,
    the second generation's collection scanned every survivor of the 50 young collections
    since its last: 52 ms for 250,000 jobs measured, about 0.5 s at the thresholds then.)"""
    if phase == "stop":
        gc.freeze()


def room_for_descriptors(max_connections: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE so that ``max_connections`` clients fit
    (many systems start services at a soft 1,024 with a far higher hard limit). Warns when
    the hard limit is too low: the shard then runs out of descriptors before the
    connection limit (it keeps serving, and new clients wait: see acceptor.py). Returns
    the soft limit now in force."""
    want = max_connections + limits.SHARD_FDS_BESIDES_CLIENTS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("RLIMIT_NOFILE allows %d descriptors, below the %d that %d connections "
                    "(limits.max_connections) need: raise LimitNOFILE", soft, want, max_connections)
    return soft


def _lock_shard_dir(path: str) -> int:
    os.makedirs(path, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a killed predecessor is being reaped
    return fd


def take_queue_settings(state: ShardState, config: Config) -> None:
    """Put the queue settings of ``config`` in force on a live state (a reload, see
    shardq/service/reload.py). The queues the state holds take their new settings; one no
    longer declared (``declare_queues``) is treated as at replay: its jobs stay reachable
    and it takes no new ones. Nothing logged depends on these settings: replay is unchanged."""
    state.config = dataclasses.replace(state.config, queue_defaults=config.queue_defaults,
                                       queues=dict(config.queues))
    for name, q in state.queues.items():
        cfg = state.config.queue(name)
        if cfg is None:
            state.undeclared.add(name)
            cfg = state.config.queue_defaults
        else:
            state.undeclared.discard(name)
        q.cfg = cfg


def _health_answer(pipe: SupervisorPipe, state: ShardState, reload_path: str) -> Callable[[bytes], None]:
    """What the loop does with the bytes of the supervisor's pipe: take new queue settings
    if asked (report.RELOAD), then answer with the queue depth."""
    def answer(got: bytes) -> None:
        if RELOAD in got:
            try:
                with open(reload_path, "rb") as f:
                    config = parse_config(json.load(f))
            except (OSError, ValueError) as e:  # InvalidConfig is a ValueError
                log.error("cannot reload the queue settings of %s, keeping those in force: %s", reload_path, e)
            else:
                take_queue_settings(state, config)
                log.info("queue settings reloaded from %s", reload_path)
                pipe.reloaded()
        pipe.pong(len(state.jobs), sum(q.counts[R] for q in state.queues.values()), state.workflow_counts["running"])
    return answer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardq-shard")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--config", default="{}", help="config as JSON (the TOML schema)")
    p.add_argument("--config-file", help="a file holding the config as JSON (what the supervisor passes)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    p.add_argument("--health-pipe", action="store_true",
                   help="answer each byte on stdin with a 'pong' line on stdout (the supervisor's pings)")
    a = p.parse_args(argv)
    if a.parent_pid:
        die_with_parent(a.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s shard-{a.index} pid={os.getpid()} %(levelname)s %(message)s")
    if a.config_file:
        with open(a.config_file, encoding="utf-8") as f:
            config = parse_config(json.load(f))
    else:
        config = parse_config(json.loads(a.config))
    # Progress every quarter health timeout: the supervisor kills a shard silent for a whole one.
    pipe = SupervisorPipe(sys.stdout, interval_s=config.service.health_timeout / 4)
    files = ReportingFiles(pipe)
    dd = DataDir(a.data_dir)
    authkey = dd.authkey()
    # ReportingFiles is a Files by delegation (it counts some calls, passes every one on), not by
    # inheritance, which would route the calls it does not count to Files rather than to inner.
    shard = DurableShard(dd.shard_dir(a.index), a.index, config, files=files)  # type: ignore[arg-type]
    shard.state.shard_count = dd.shards()  # which shard owns a placed queue (docs/limits.md)
    try:
        with pipe.busy("replay", lambda: shard.log.stats.records + files.bytes_read):
            lock_fd = _lock_shard_dir(dd.shard_dir(a.index))
            stats = shard.open(SystemClock().now(), compact=False)  # logs what it replayed
            # A log due for compaction: compact now, or for want of space start from the log
            # as it is (an optimisation, never a condition to serve: DurableShard.compact).
            with files.expecting_no_space():
                if shard.compaction_due():
                    shard.compact()
    except CorruptLog as e:
        log.error("refusing to start: %s", e)
        pipe.corrupt(e.path, e.offset, e.reason)
        return EXIT_CORRUPT
    except OSError as e:  # the disk: full, read-only, failing
        log.error("cannot start: %s", e)
        pipe.failed("disk_full" if e.errno in NO_SPACE else "io_error", str(e), e.filename)
        return EXIT_LOG_FAILED
    except LogFailed as e:  # the start's own record (a new token epoch) could not be written, or
        log.error("cannot start: %s", e)  # a compaction failed other than for want of space
        cause = e.__cause__
        if not (isinstance(cause, OSError) and cause.errno in NO_SPACE):
            pipe.failed("io_error", str(e), None)  # a full disk: ReportingFiles said so, with the file
        return EXIT_LOG_FAILED
    boot = boot_fence.start(dd.shard_dir(a.index), a.index, config, SystemClock().now())
    shard.state.fence_placed(boot.fence_until)
    tune_gc()
    room_for_descriptors(config.limits.max_connections)
    pipe.watch_disk(files)  # a commit stalled on a slow disk is not a hang
    if a.health_pipe:
        os.set_blocking(sys.stdin.fileno(), False)
    @contextmanager
    def busy(phase: str) -> Iterator[None]:
        # A compaction that finds no space is given up and the shard goes on: no "failed" line.
        with pipe.busy(phase, lambda: files.bytes_written), \
                (files.expecting_no_space() if phase == "compact" else nullcontext()):
            yield

    server = ShardServer(shard, dd.socket_path(a.index), authkey, busy=busy,
                         health=(sys.stdin.fileno(), _health_answer(
                             pipe, shard.state, os.path.join(dd.run_dir, RELOAD_FILE))) if a.health_pipe else None)
    server.early_placed_s = boot.early_visibility_s
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())

    def ready() -> None:
        pipe.ready(stats.records, stats.seconds, len(shard.state.jobs))
        log.info("ready: listening on %s", server.sock_path)

    written_at_start = shard.log.bytes_since_checkpoint  # the start's own record: no checkpoint for it
    profile_path = os.environ.get("SHARDQ_PROFILE")  # bench/probes/profile_shard.py: cProfile of the shard loop
    profiler = None
    if profile_path:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        server.serve(ready)
    except LogFailed as e:
        log.error("log failed, exiting so the supervisor restarts and replays: %s", e)
        return EXIT_LOG_FAILED
    except InvariantViolation as e:
        log.exception("internal error, exiting so the supervisor restarts and replays: %s", e)
        return EXIT_BUG
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(f"{profile_path}.shard{a.index}")
    since = shard.log.bytes_since_checkpoint
    if since > written_at_start and since >= max(STOP_CHECKPOINT_MIN_BYTES,
                                                 STOP_CHECKPOINT_SHARE * shard.log.checkpoint_bytes):
        # A checkpoint on the way down: the next start replays it, not this run's records.
        # Cut short (SIGKILL at the supervisor's grace), it leaves the log as it was; so does
        # one that finds no space (it says so), and the shard stops cleanly all the same.
        try:
            with files.expecting_no_space():
                shard.compact()
        except LogFailed as e:
            log.error("no checkpoint on the way down, the next start replays the log: %s", e)
            return EXIT_LOG_FAILED
    shard.close()
    try:
        boot_fence.stopped_cleanly(dd.shard_dir(a.index), boot)
    except OSError as e:  # the next start takes this run for one that did not stop cleanly
        log.error("stopped, but could not record it: %s", e)
    os.close(lock_fd)
    log.info("stopped cleanly")
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: tearing down the interpreter frees every job one by one (1.8 s for a
    # million), which would only lengthen the stop; the log is closed, the kernel does the rest.
    os._exit(code)
