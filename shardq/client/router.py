"""The router: the threaded client producer and worker apps embed (``shardq.connect``).

An executor of the client engine (:mod:`.engine`: every call, the retry after a break, the lease rounds and
waits) over one connection per shard (:mod:`.connection`, a shell around the connection state machine of
:mod:`.channel`); it moves requests and waits, with threads. The guarantees (routing, sessions, the retry
table, long polls) are the engine's and the core's (:mod:`.core`). One router can be shared by many threads;
their requests are pipelined per shard, and their replies read by each connection's reader thread, which
wakes the caller. A lone call takes the fast path (``ShardClient.call_solo``): it reads its reply itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import logging
import os
import threading
import time

from .connection import SHARED, Future, ShardClient
from ..busypoll import BUSY_POLL_US_DEFAULT
from ..clock import Clock, SystemClock
from ..datadir import DataDir
from ..errors import Closed, ShardUnavailable
from ..types import Lease
from .effects import OPEN, Abandon, Collect, Owner, Park, Send, Sleep, Submit, SyncExecutor, Wake, deliver
from .engine import Calls, learn_owner, place
from .core import WITHDRAW_SETTLE_S, Call, ConnectionLost, ack_error, release_call
from .routing import job_item, lease_shard
from .routing import shard_for_key, shard_of_job  # noqa: F401 - imported from here too (tests, tools)

if TYPE_CHECKING:
    from .contracts import Control, Results
    from .queue import Queue

log = logging.getLogger("shardq.router")


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
        # clock: every deadline, retry and wait of this router and its connections (shardq/clock.py)
        self.clock = clock or SystemClock()
        self._mono = self.clock.monotonic
        self.clients = [ShardClient(i, dd.socket_path(i), key, _role, busy_poll_us, self.clock, self.client_id,
                                    self._release_rows) for i in range(self.shards)]
        self._chans = [c.chan for c in self.clients]
        self._bind_effects()
        self._supervisor = supervisor

    # ------------------------------------------------------------------ the executor
    def _now(self) -> float:
        return self._mono()

    def _do_send(self, effect: Send) -> list[Any]:
        calls, retry_s, timeout_s, errors = effect
        if len(calls) == 1 and timeout_s is None and calls[0][1] != "enqueue":  # the shortest path
            try:
                return [self._call(*calls[0], retry_s=retry_s, with_resent=True)]
            except Exception as e:
                if not errors:
                    raise
                return [e]  # returned in its place
        deadline = self._mono() + (self.retry_s if retry_s is None else retry_s)
        return self._drive(deliver(self, calls, deadline, timeout_s, errors))

    def _learn_owner(self, effect: Owner) -> int | None:
        return self._drive(learn_owner(self, effect.queue, effect.ask))

    @staticmethod
    def _sleep(effect: Sleep) -> None:
        time.sleep(effect.seconds)

    def _send(self, shard: int, op: str, args: list[Any], deadline: float) -> Future:
        """Submit one request, connecting first; one never written is submitted again here
        (what becomes of one that was is the engine's decision)."""
        client = self.clients[shard]
        while True:
            if self._closed:
                raise Closed("router is closed")
            client.ensure_connected(deadline)
            fut = client.submit(op, args)
            if not (fut.done and isinstance(fut.error, ConnectionLost) and not fut.error.sent):
                return fut
            if self._mono() >= deadline:
                raise ShardUnavailable(f"shard {shard}: {fut.error}")

    def _submit(self, effect: Submit) -> list[Future | BaseException]:
        """Do a :class:`~.effects.Submit`: the first call to a shard is sent as :meth:`_send`
        does (connecting first; its error stands in its place); the later ones only on the
        connection it went on (``on=``), so one that finds it gone fails unsent, and the
        engine sends it again after the calls before it."""
        futs: list[Future | BaseException] = []
        first_on: dict[int, Future | BaseException] = {}  # shard -> its first call's future or error
        for s, op, args in effect.calls:
            first = first_on.get(s)
            if first is None:
                try:
                    first = first_on[s] = self._send(s, op, args, effect.deadline)
                except ShardUnavailable as e:
                    first = first_on[s] = e
                futs.append(first)
            elif isinstance(first, BaseException):
                futs.append(ShardUnavailable(str(first)))  # as its first call: nothing to send it on
            else:
                futs.append(self.clients[s].submit(op, args, on=first.epoch))
        return futs

    def _collect(self, effect: Collect) -> list[Any]:
        """Do a :class:`~.effects.Collect`: sleep on each future until the reader thread settles it."""
        _, handles, timeout = effect
        end = None if timeout is None else self._mono() + timeout  # ``timeout``: for all the calls together
        for f in handles:
            if isinstance(f, Future):
                f.wait(self.request_timeout_s if end is None else end - self._mono())
        return [_outcome(f) for f in handles]

    def _call(self, shard: int, op: str, args: list[Any], *, retry_s: float | None = None,
              with_resent: bool = False) -> Any:
        """One request, its value (``with_resent``: and whether it was re-sent) or its
        error, on the shortest path: alone on the connection, it is sent and read in this
        thread (``call_solo``); a break, or company, hands it to the engine."""
        deadline = self._mono() + (self.retry_s if retry_s is None else retry_s)
        solo: Any = SHARED if self._closed else self.clients[shard].call_solo(op, args, self.request_timeout_s)
        got = None
        if solo is not SHARED:
            value, lost = solo
            if lost is None:
                return (value, False) if with_resent else value
            if type(lost) is TimeoutError:
                raise ShardUnavailable(f"shard {shard} did not answer {op} within {self.request_timeout_s:.1f} s")
            got = [lost]
        [(value, resent)] = self._drive(deliver(self, [(shard, op, args)], deadline, got=got))
        return (value, resent) if with_resent else value

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
        shard = self._placed(queue, key, priority)
        if shard is None:
            shard = self._drive(place(self, queue, key, priority))
        session = (sessions := self._chans[shard].sessions).open()  # (Calls._session, one call less)
        try:
            ids: list[int] = self._call(shard, "enqueue", [[item], session])
            return ids[0]
        finally:
            sessions.close(session)

    def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if the lease is no longer current (nothing changes)."""
        errs, retried = self._call(lease_shard(lease, self.shards), "ack", [[[lease.job_id, lease.token]]],
                                   with_resent=True)
        if errs[0] is not None and (err := ack_error(errs[0], retried)) is not None:
            raise err

    def _park(self, effect: Park) -> tuple[threading.Event, list[Future | None]]:
        """Do a :class:`~.effects.Park`; the token is the event the replies set."""
        event = threading.Event()
        handles: list[Future | None] = []
        calls = effect.calls
        for shard, op, args in calls:
            if len(calls) == 1 and op == "dequeue_wait" and self.clients[shard].connected:
                fut = Future()  # sent by the waiting caller itself, on the lone-call path (_wait_solo)
            else:
                try:
                    fut = self._send(shard, op, args, self._mono())
                except ShardUnavailable:
                    handles.append(None)  # down: the others serve
                    continue
            fut.callback = lambda f: event.set()
            handles.append(fut)
        return event, handles

    def _wake(self, effect: Wake) -> list[Any]:
        """Do a :class:`~.effects.Wake`: sleep on the event until the reader threads have
        settled one more of the futures, or the deadline passes."""
        event, calls, handles, deadline, settled = effect
        if len(handles) == 1 and (lone := handles[0]) is not None and lone.req is None and not lone.done:
            if (got := self._wait_solo(calls[0], lone, deadline)) is not None:
                return [got]  # read by this thread on the lone-call path: nobody to wake
        futs = [f for f in handles if f is not None]
        while True:
            event.clear()  # before the count: a future settled after it sets the event again
            remaining = deadline - self._mono()
            if remaining <= 0 or sum(f.done for f in futs) > settled:
                return [_outcome(f) for f in handles]
            event.wait(remaining)

    def _wait_solo(self, call: Call, fut: Future, deadline: float) -> Any:
        """A lone waiting dequeue (:meth:`_park`), sent and read by this thread (``call_solo``);
        its outcome as :class:`~.effects.Wake`'s (:data:`OPEN`: withdrawn past ``deadline``), or
        None when a connection another thread uses meanwhile had it sent as any other (``fut``)."""
        client = self.clients[call.shard]
        got: Any = SHARED if self._closed else client.call_solo(call.op, call.args, deadline - self._mono(), True)
        if got is SHARED:
            client.submit(call.op, call.args, fut=fut)  # (no connection: fails unsent)
            return None
        if type(got[1]) is TimeoutError:
            return OPEN
        (fut.value, fut.error), fut.done = got, True  # only this thread knows ``fut``: no lock, no wake-up
        return got[0] if got[1] is None else got[1]

    def _abandon(self, effect: Abandon) -> list[Any]:
        """Do an :class:`~.effects.Abandon` (:meth:`~.channel.Channel.abandon`)."""
        _, calls, handles = effect
        for (shard, _, _), fut in zip(calls, handles):
            # answered just before: its reply is settled by the thread that read it, and
            # goes back to the operation (which takes or releases its leases), as asyncio's
            if isinstance(fut, Future) and not fut.done and self.clients[shard].forget(fut):
                fut.wait(WITHDRAW_SETTLE_S)
        return [_outcome(f) for f in handles]

    def _release(self, leases: list[Lease]) -> None:
        for lease in leases:
            try:
                self._send(*release_call(lease), self._mono())
            except (ShardUnavailable, Closed) as e:
                log.info("releasing lease %s failed (%s); it expires by itself", lease.job_id, e)

    def close(self) -> None:
        """Close connections; an embedded service (``shardq.open``) is stopped too."""
        if self._closed:
            return
        # A withdrawn wait's lease may still be on its way: let it come and be released
        # (unstarted), rather than expire held by nobody with its delivery counted.
        end = self._mono() + WITHDRAW_SETTLE_S
        for c in self.clients:
            c.settle_orphans(max(0.0, end - self._mono()))
        self._closed = True
        for c in self.clients:
            c.close()
        if self._supervisor is not None:
            self._supervisor.stop()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(fut: Future | BaseException | None) -> Any:
    """What a call was answered: :data:`~.effects.OPEN`, its value or its error."""
    if isinstance(fut, BaseException):
        return fut
    if fut is None or not fut.done:
        return OPEN
    return fut.value if fut.error is None else fut.error


if TYPE_CHECKING:  # mypy checks the declared contracts (client/contracts.py) hold
    def _contracts(q: Router) -> tuple[Queue, Control, Results]:
        return q, q, q
