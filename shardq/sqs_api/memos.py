"""Memos: what the SQS API remembers beside its messages (FIFO dedup across groups,
ReceiveRequestAttemptId answers, first receive times), durable and shared by every process
that serves the SQS API of one data dir, through shardq's public client API only.

A memo is a job of one internal shardq queue, :data:`QUEUE` (``sqs-api.memos``: a name no
SQS queue can have, since SQS names hold no dot but the one of ``.fifo``, so it is never
listed nor reached by an SQS call). Its key says what it is about (``kind``, a newline, the
scope: ``d\\norders.fifo\\nid-7``), and it is enqueued with the dedup id ``"1"``. So the
first enqueue of a key within the memo queue's ``dedup_window`` makes the memo, fsynced
before it returns, and every later one, from any process and across restarts, returns that
same job, whose body is read back with ``job()``: JSON ``{"v": value, "u": lapses at (ms),
"n": nonce}``. The nonce tells the caller whether the memo read back is the one it wrote
(it claimed the key) or an earlier one (whose value it then uses).

A memo is enqueued delayed for as long as it means something; once due, the sweeper (a
task on the event loop of each SQS API process, every :data:`SWEEP_EVERY_S`) leases and acks it. The dedup
entry of its key outlives it until the memo queue's ``dedup_window`` ends (shardq keeps a
dedup id after the job is gone): a claim of a key whose memo has lapsed within that time
gets ``None`` (it can neither use the old value nor write a new one).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..clock import Clock
from ..errors import NotFound, ShardqError, UnknownQueue
from .faults import fault

log = logging.getLogger("shardq.sqs_api")

QUEUE = "sqs-api.memos"
DEDUP = "1"                 # the key is the memo's identity; one dedup id per key
SWEEP_EVERY_S = 30.0        # how often lapsed memos are deleted
SWEEP_BATCH = 1000
SWEEP_LEASE_S = 60.0


class Claim(NamedTuple):
    kind: str
    scope: str
    value: Any                 # JSON
    lifetime_s: float          # the memo means something for this long


class Memo(NamedTuple):
    mine: bool                 # this call made it
    value: Any                 # its value (this call's when mine)


class Memos:
    """The memos of one SQS API process (see the module docstring), over its
    :class:`~shardq.client.aio.AsyncQueue` ``q``; used on that queue's event loop only."""

    def __init__(self, q: Any, clock: Clock):
        self.q, self.clock = q, clock
        self._stopped = False
        self._sweeper: asyncio.Task[None] | None = None

    async def claim(self, kind: str, scope: str, value: Any, lifetime_s: float) -> Memo | None:
        return (await self.claim_many([Claim(kind, scope, value, lifetime_s)]))[0]

    async def claim_many(self, claims: Sequence[Claim]) -> list[Memo | None]:
        """Per claim: ``Memo(True, value)`` if this call made the memo, ``Memo(False, the
        earlier value)`` if a live one was there, None if the one there has lapsed. One
        enqueue request per shard (fsynced), then one ``job()`` look-up per claim."""
        return (await self.enqueue_and_claim([], claims))[1]

    async def enqueue_and_claim(self, jobs: list[dict[str, Any]], claims: Sequence[Claim]
                          ) -> tuple[list[int], list[Memo | None]]:
        """Enqueue ``jobs`` (job dicts naming their queue) and the memos of ``claims`` in one
        ``enqueue_many``: one request per shard, sent together, so their fsyncs overlap.
        Returns the jobs' ids and the claims' memos (as :meth:`claim_many`)."""
        if not claims:
            return (await self.q.enqueue_many(jobs) if jobs else []), []
        self._start_sweeper()
        now_ms = int(self.clock.now() * 1000)
        nonce = secrets.token_hex(8)
        memos = [{"body": json.dumps({"v": c.value, "u": now_ms + int(c.lifetime_s * 1000), "n": f"{nonce}.{i}"},
                                     separators=(",", ":")).encode(),
                  "key": f"{c.kind}\n{c.scope}", "delay": max(1.0, c.lifetime_s), "dedup_id": DEDUP,
                  "queue": QUEUE}
                 for i, c in enumerate(claims)]
        try:
            ids = await self.q.enqueue_many(jobs + memos, queue=QUEUE)
        except UnknownQueue as e:
            if QUEUE not in str(e):
                raise
            raise fault("InternalFailure", f"The SQS API keeps its memos in the shardq queue {QUEUE!r}, which this "
                                         f"service does not declare (service.declare_queues = true): declare "
                                         f"[queues.\"{QUEUE}\"] in its config.") from None
        out: list[Memo | None] = []
        # the look-ups at once: on the loop, each is a request of the same turn
        found = await asyncio.gather(*(self.q.job(job_id) for job_id in ids[len(jobs):]), return_exceptions=True)
        for i, (c, job) in enumerate(zip(claims, found)):
            if isinstance(job, NotFound):  # lapsed and swept meanwhile
                out.append(None)
                continue
            if isinstance(job, BaseException):
                raise job
            memo = json.loads(job["body"])
            if memo.get("n") == f"{nonce}.{i}":
                out.append(Memo(True, c.value))
            elif memo.get("u", 0) > now_ms:
                out.append(Memo(False, memo.get("v")))
            else:
                out.append(None)
        return ids[:len(jobs)], out

    # ------------------------------------------------------------------ the sweeper
    def _start_sweeper(self) -> None:
        if self._sweeper is None and not self._stopped:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="shardq-sqs-memos")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                await self.sweep()
            except ShardqError as e:  # a shard down: the next round
                log.info("event=sqs-api-memo-sweep-failed error=%s", e)

    async def sweep(self) -> int:
        """Delete the memos that have lapsed (they are due: their delay was their life)."""
        gone = 0
        while not self._stopped:
            leases = await self.q.dequeue_many(QUEUE, max_jobs=SWEEP_BATCH, wait=0.0, visibility=SWEEP_LEASE_S)
            if not leases:
                break
            await self.q.ack_many(leases)
            gone += len(leases)
        return gone

    async def close(self) -> None:
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()  # a round cut short: what it leased expires, and is swept next time
            await asyncio.gather(self._sweeper, return_exceptions=True)
