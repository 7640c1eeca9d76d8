"""Workflows on the asyncio worker (AsyncWorker, as ``shardq worker`` runs a queue with
async tasks), with an idempotency store: async members report from the event loop's
worker, a plain callback runs in a thread through the loop's client, progress of an async
task is written without blocking the loop."""
from __future__ import annotations

import asyncio
import threading

import shardq
from shardq import chord, group
from shardq.consumer.aioworker import AsyncWorker
from shardq.consumer.idempotency import SqliteStore
from shardq.tasks.dispatch import TaskHandler

from support.service import Service, wait_until

MEMBERS = 20


def test_a_chord_of_async_members_on_the_asyncio_worker_with_a_store(tmp_path):
    store = SqliteStore(str(tmp_path / "fx.sqlite"))
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE fx (job_id INTEGER, i INTEGER)")
    with Service(shards=2) as svc:
        app = shardq.App(svc.data_dir)
        gate = threading.Event()

        @app.task(queue="awf", name="awf.member", keep_result=60)
        async def member(ctx, i: int) -> int:
            ctx.progress(0.5, f"member {i}")
            if i == 0:
                await asyncio.to_thread(gate.wait, 30)  # until its progress has been seen
            await ctx.db.execute("INSERT INTO fx(job_id, i) VALUES (?, ?)", (ctx.job_id, i))
            return i + 1

        @app.task(queue="awf", name="awf.total")
        def total(ctx, xs: list) -> dict:
            return {"sum": sum(xs), "n": len(xs)}

        wf = chord(group(member.s(i) for i in range(MEMBERS)), total.s()).send()
        first = next(r["job_id"] for r in wf.status() if r["step"] == "0.0.0")
        w = AsyncWorker(app.target, TaskHandler(app.tasks), queue="awf", idle_wait_s=0.05, idempotency=store)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        try:
            wait_until(lambda: app.status(first)["note"] == "member 0", 30, 0.01, "member 0's progress")
            assert app.status(first)["progress"] == 0.5 and app.status(first)["state"] == "leased"
            gate.set()
            assert wf.result(timeout=60) == {"sum": sum(range(1, MEMBERS + 1)), "n": MEMBERS}
            assert app.result(first, timeout=10) == 1
        finally:
            gate.set()
            w.stop()
            t.join(30)
            app.close()
    with store.transaction() as txn:
        rows = txn.db.execute("SELECT i FROM fx ORDER BY i").fetchall()
    store.close()
    assert [i for (i,) in rows] == list(range(MEMBERS))
