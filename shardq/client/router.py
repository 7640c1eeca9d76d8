"""The router: the threaded client producer and worker apps embed (``shardq.connect``).

An executor of the client engine (:mod:`.engine`: every call, the retry after a break, the lease rounds and
waits) for threads. The guarantees (routing, sessions, the retry table, long polls) are the engine's and the
core's (:mod:`.core`). One router can be shared by many threads. It moves calls three ways:

* **A single call** that finds a free lane of its shard (:class:`~.connection.Lanes`: up to
  ``LANES_MAX`` blocking connections, one caller on each) is written and read by its caller there: no
  other thread, no hand-off, a busy poll for the reply. A waiting dequeue alone too.
* **Single enqueues and acks** that meet their shard's first lane taken are combined
  (:mod:`.combine`): one leader sends all that wait as one request, on a lane.
* **Everything else** (a call that finds every lane taken, batches across shards, waits on many shards,
  watches, re-sends after a break) is done by the asyncio client (:class:`~.aio.AsyncQueue`) on the
  router's I/O thread, started when first needed: its connections pipeline many threads' calls and
  reconnect. A thread hands it the effect and sleeps until the I/O thread settles it.

Both ways share each shard's enqueue sessions (:class:`~.core.Sessions`), so an enqueue re-sent the other
way is still answered with its first ids.

A process forked from one whose router had connected (gunicorn's ``--preload``, a
multiprocessing pool on ``fork``) gets the router afresh in the child: new lanes and
sessions, no I/O thread yet; the parent's connections are left to the parent. Shared, the
two processes read each other's replies (found: both timed out, on calls the shard had
applied).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial

from .aio import AsyncQueue
from .combine import Combiner
from .connection import SHARED, Lanes
from ..busypoll import BUSY_POLL_US_DEFAULT
from ..loop_thread import LoopThread
from ..clock import Clock, SystemClock
from ..datadir import DataDir
from ..errors import Closed, ShardUnavailable
from ..types import Lease
from .effects import OPEN, Abandon, Collect, Owner, Park, Send, Sleep, Submit, SyncExecutor, Wake, deliver
from .engine import Calls, combined, learn_owner, new_client_id, place
from .core import ConnectionLost, ack_error, no_answer
from .routing import job_item, lease_shard
from .routing import shard_for_key, shard_of_job  # noqa: F401 - imported from here too (tests, tools)

if TYPE_CHECKING:
    from .contracts import Control, Results
    from .queue import Queue

log = logging.getLogger("shardq.router")
T = TypeVar("T")
_SLICE_S = 1.0  # a thread waiting for the I/O thread looks this often whether it was stopped
# The I/O thread's first connects take this long at most: it starts for a call whose own
# retry_s runs meanwhile (a shard not reached is connected to when a request needs it)
IO_CONNECT_S = 0.25


class Router(Calls, SyncExecutor):
    """Client of a running shardq service. See the module docstring for the guarantees.
    Its calls beside the hot ones below come from the one table of both clients
    (:class:`~shardq.client.engine.Calls`)."""

    def __init__(self, data_dir: str | os.PathLike[str], *, retry_s: float = 15.0, request_timeout_s: float = 30.0,
                 busy_poll_us: int = BUSY_POLL_US_DEFAULT, supervisor: Any = None, _role: str = "client",
                 clock: Clock | None = None) -> None:
        # _role "service": a part of shardq serve itself (HTTP listener, schedules), whose
        # connections a shard holds apart from its clients' limit (protocol/sockio.py)
        # busy_poll_us: how long a lone call polls for its reply before it sleeps (shardq/busypoll.py)
        dd = DataDir(data_dir)
        self._init_calls(dd, retry_s, request_timeout_s)
        key = dd.authkey()  # before the service check: a key file others can read is refused as such
        if supervisor is None:
            dd.require_service()  # fail now, not after retry_s, when no service runs at all
        if _role == "service":
            busy_poll_us = 0  # serve's own calls are not latency-bound: no CPU spent on them
        # clock: every deadline and retry of this router and its lanes (shardq/clock.py)
        self.clock = clock or SystemClock()
        self._mono = self.clock.monotonic
        self._role = _role
        self._lane_args = [(dd.socket_path(i), key, _role, busy_poll_us, self.clock) for i in range(self.shards)]
        self._connections()
        self._bind_effects()
        self._supervisor = supervisor
        self._watch_forks()

    def _connections(self) -> None:
        """This process's lanes, combiners and enqueue sessions; the I/O thread is started later."""
        self.lanes = [Lanes(i, *args, client_id=self.client_id, release=self._release_rows)
                      for i, args in enumerate(self._lane_args)]
        self._chans = [lane.chan for lane in self.lanes]  # their enqueue sessions serve both ways
        self._combiners = [(Combiner(partial(self._round, i, "enqueue")), Combiner(partial(self._round, i, "ack")))
                           for i in range(self.shards)]  # a round: engine.combined
        self._io: AsyncQueue | None = None
        self._io_thread: LoopThread | None = None
        self._io_lock = threading.Lock()

    def _forked(self) -> None:
        """In a child forked from this router's process: the child's own connections, from
        now on, under a client id of its own (a shard keeps enqueue sessions per client id).
        The parent's sockets are closed in the child without a word to the shard; its I/O
        loop is kept, unused, for ever: closing it would unregister the parent's sockets from
        the epoll instance both processes share. An embedded service stays the parent's."""
        _LEFT_BY_FORK.append((self._io, self._io_thread))
        for lane in self.lanes:
            lane.forget()
        self.client_id = new_client_id()
        self._supervisor = None
        self._connections()

    # ------------------------------------------------------------------ the I/O thread
    def _shared(self) -> AsyncQueue:
        """The asyncio client on this router's I/O thread, started by the first call that needs it."""
        io = self._io
        if io is not None:
            return io
        with self._io_lock:
            if self._closed:
                raise Closed("router is closed")
            if self._io is None:
                io = AsyncQueue(self.data_dir, retry_s=self.retry_s, request_timeout_s=self.request_timeout_s,
                                _role=self._role)
                lt = LoopThread("shardq-io", owner="router")
                try:
                    lt.call(io._open(check=False, connect_s=IO_CONNECT_S), None)
                except BaseException:
                    lt.close()
                    raise
                for conn, chan in zip(io.conns, self._chans):
                    conn.chan.sessions = chan.sessions
                self._io_thread, self._io = lt, io
            return self._io

    def _on_io(self, start: Callable[[AsyncQueue], Awaitable[T]]) -> T:
        """Run ``start(io)`` on the I/O thread and sleep until it ends (:meth:`LoopThread.wait`:
        an error in this thread, KeyboardInterrupt, cancels it there, and the operation
        abandons its calls)."""
        io = self._shared()
        assert self._io_thread is not None  # (started with io)
        return self._io_thread.wait(lambda: start(io), _SLICE_S)

    def _io_time(self, io: AsyncQueue, deadline: float) -> float:
        """``deadline`` on this router's clock, on the I/O thread's."""
        return io.loop.time() + (deadline - self._mono())

    # ------------------------------------------------------------------ the executor
    def _now(self) -> float:
        return self._mono()

    def _do_send(self, effect: Send) -> list[Any]:
        calls, retry_s, timeout_s, errors = effect
        # the shortest path: a lane, else one request there; but a dequeue under a wait of its
        # own (a lease round's HELD_STEP_S) goes the shared way, whose reader releases a late
        # reply's leases at once (on a lane, its next caller would)
        if len(calls) == 1 and (timeout_s is None or calls[0][1] != "dequeue"):
            shard, op, args = calls[0]
            session = op == "enqueue" and args[1] is None  # (a batch's: deliver's rule)
            if session:
                args[1] = self._session(shard)
            try:
                return [self._call(shard, op, args, retry_s=retry_s, timeout_s=timeout_s)]
            except Exception as e:
                if not errors:
                    raise
                return [e]  # returned in its place
            finally:
                if session:
                    self._done(shard, args[1])
        return self._on_io(lambda io: io._do_send(effect))

    def _learn_owner(self, effect: Owner) -> int | None:
        return self._drive(learn_owner(self, effect.queue, effect.ask))

    @staticmethod
    def _sleep(effect: Sleep) -> None:
        time.sleep(effect.seconds)

    def _submit(self, effect: Submit) -> list[Any]:
        return self._on_io(
            lambda io: io._submit(effect._replace(deadline=self._io_time(io, effect.deadline))))

    def _collect(self, effect: Collect) -> list[Any]:
        return self._on_io(lambda io: io._collect(effect))

    def _call(self, shard: int, op: str, args: list[Any], *, retry_s: float | None = None,
              timeout_s: float | None = None) -> tuple[Any, bool]:
        """One request and whether it was re-sent (its error is raised): on the lane when it is
        free, else the shared way. A break is the engine's to decide (:func:`~.effects.deliver`,
        until ``retry_s``), its re-sends going the shared way. ``timeout_s``: the wait for the
        reply, if shorter than the request timeout (:class:`~.effects.Send`'s)."""
        start = self._mono()
        deadline = start + (self.retry_s if retry_s is None else retry_s)
        got = self.lanes[shard].call(op, args, self.request_timeout_s if timeout_s is None else timeout_s)
        if got is SHARED:  # one request on the I/O thread's connection, no operation there
            if timeout_s is not None:  # (under the effect's own wait: its operation)
                outcome: tuple[Any, bool] = self._on_io(
                    lambda io: io._do_send(Send([(shard, op, args)], retry_s, timeout_s)))[0]
                return outcome
            try:  # (its retries: what the lane left of the call's retry_s)
                got = self._on_io(lambda io: io._request(shard, op, args, max(0.0, deadline - self._mono()))[2]), None
            except ConnectionLost as e:
                got = None, e
        value, lost = got
        if lost is None:
            return value, False
        if type(lost) is TimeoutError:
            raise no_answer(shard, op, self.request_timeout_s if timeout_s is None else timeout_s)
        ((value, resent),) = self._drive(deliver(self, [(shard, op, args)], deadline, got=[lost]))
        return value, resent

    def _round(self, shard: int, op: str, items: list[Any]) -> list[Any]:
        return self._drive(combined(shard, op, items))

    def _add_status(self, shards: list[dict[str, Any]]) -> None:
        if self._supervisor is None:
            return super()._add_status(shards)
        for sh in shards:  # the embedded supervisor's view
            sh.update(self._supervisor.process_stats(sh["shard"]))

    # ------------------------------------------------------------------ the hot calls
    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                priority: int = 0, dedup_id: str | None = None) -> int:
        """Durably add a job; returns its id once the owning shard has fsynced it.

        ``dedup_id``: a second enqueue with the same id (same queue and key) within the
        queue's dedup window returns the first job's id and adds nothing."""
        item = job_item(body, key, queue, delay, priority, dedup_id)
        shard = self._placed(queue, key, priority, dedup_id)
        if shard is None:
            shard = self._drive(place(self, queue, key, priority, dedup_id))
        if self.lanes[shard].all[0].lock.locked():  # another call is on the first lane: combined
            job_id: int = self._combiners[shard][0].call(item, len(body), self.request_timeout_s)
            return job_id
        session = (sessions := self._chans[shard].sessions).open()  # (Calls._session, one call less)
        try:
            ((job_id,), _) = self._call(shard, "enqueue", [[item], session])  # a lone caller's: on the lane
            return job_id
        finally:
            sessions.close(session)

    def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost (nothing changes) if it was leased again since (an ack past
        the lease's deadline still deletes it while nobody leased it since)."""
        shard, pair = lease_shard(lease, self.shards), [lease.job_id, lease.token]
        if self.lanes[shard].all[0].lock.locked():  # another call is on the first lane: combined
            err, resent = self._combiners[shard][1].call(pair, 0, self.request_timeout_s)
        else:
            (err,), resent = self._call(shard, "ack", [[pair]])  # (a lone caller's: on the lane)
        if err is not None and (error := ack_error(err, resent)) is not None:
            raise error

    # ------------------------------------------------------------------ waits
    def _park(self, effect: Park) -> tuple[None, list[Any]]:
        """Do a :class:`~.effects.Park`: a lone waiting dequeue whose lane is free is only
        noted (its caller sends it on the lane in :meth:`_wake`); the others go the shared way."""
        calls = effect.calls
        if len(calls) == 1 and calls[0].op == "dequeue_wait" and not self.lanes[calls[0].shard].busy():
            return None, [_Lone()]
        return self._on_io(lambda io: io._park(effect))

    def _wake(self, effect: Wake) -> list[Any]:
        """Do a :class:`~.effects.Wake`; a lone wait (:meth:`_park`) is sent and read here."""
        handles = effect.handles
        if handles and type(lone := handles[0]) is _Lone:
            if lone.done:
                return [lone.outcome]
            (call,) = effect.calls
            got = self.lanes[call.shard].call(call.op, call.args, effect.deadline - self._mono(), True)
            if got is not SHARED:
                if type(got[1]) is TimeoutError:
                    return [OPEN]  # withdrawn on the lane
                lone.done, lone.outcome = True, got[0] if got[1] is None else got[1]
                return [lone.outcome]
            # the lane was taken meanwhile: the wait goes the shared way, in the lone one's place
            _, (shared,) = self._on_io(lambda io: io._park(Park(effect.calls)))
            if shared is None:  # (answered here: the handle stays, so the wait counts it answered)
                lone.done, lone.outcome = True, ShardUnavailable(f"shard {call.shard} is not connected")
                return [lone.outcome]
            handles[0] = shared
        deadline = effect.deadline
        return self._on_io(
            lambda io: io._wake(effect._replace(deadline=self._io_time(io, deadline))))

    def _abandon(self, effect: Abandon) -> list[Any]:
        """Do an :class:`~.effects.Abandon` (:meth:`~.channel.Channel.abandon`); a lone wait
        not answered was withdrawn on the lane already."""
        handles = effect.handles
        if handles and type(lone := handles[0]) is _Lone:
            return [lone.outcome if lone.done else OPEN]
        return self._on_io(lambda io: io._abandon(effect))

    def _release(self, leases: list[Lease]) -> None:
        try:
            io = self._shared()
            io.loop.call_soon_threadsafe(io._release, leases)
        except (Closed, RuntimeError) as e:
            log.info("releasing %d leases failed (%s); they expire by themselves", len(leases), e)

    def close(self) -> None:
        """Close the lanes and the I/O thread's connections (a withdrawn wait's lease still on
        its way gets a moment to come and be released); an embedded service
        (``shardq.open``) is stopped too."""
        with self._io_lock:
            if self._closed:
                return
            self._closed = True
            io = self._io
        for lane in self.lanes:
            lane.close()
        if io is not None:
            assert self._io_thread is not None  # (started with io)
            self._io_thread.call(io.close(), None)
            self._io_thread.close()
        if self._supervisor is not None:
            self._supervisor.stop()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LEFT_BY_FORK: list[Any] = []  # the parents' I/O loops, in a forked child (Router._forked)


class _Lone:
    """The handle of a lone waiting dequeue (:meth:`Router._park`): its outcome once the
    lane brought it."""

    __slots__ = ("done", "outcome")

    def __init__(self) -> None:
        self.done = False
        self.outcome: Any = None


if TYPE_CHECKING:  # mypy checks the declared contracts (client/contracts.py) hold
    def _contracts(q: Router) -> tuple[Queue, Control, Results]:
        return q, q, q
