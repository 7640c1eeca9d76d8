"""The tasks. Run them with ``shardq worker examples.tasks_app.tasks --idempotency
var/example.sqlite``; send jobs with ``python -m examples.tasks_app.produce``.

Both tasks write their effect through ``ctx.db``, the idempotency store's transaction, so
a job delivered twice (a worker killed mid-task, a lease that ran out) has its row once.
"""
from __future__ import annotations

import asyncio
import os
import sqlite3
import time

import shardq

app = shardq.App(os.environ.get("SHARDQ_DATA_DIR", "var/shardq"))

#: Seconds each task pretends to work (the end-to-end test makes it slow, to kill workers
#: in the middle of a task).
WORK_S = float(os.environ.get("EXAMPLE_WORK_S", "0"))


@app.task(queue="signups", key=lambda user_id, **_: f"user-{user_id}", retries=3,
          backoff=shardq.Exponential(base_s=0.1, cap_s=2))
def record_signup(ctx, user_id: int, email: str) -> None:
    """A plain function: the worker runs it in a thread."""
    if WORK_S:
        time.sleep(WORK_S)
    ctx.db.execute("INSERT INTO signups(job_id, user_id, email, attempt) VALUES (?, ?, ?, ?)",
                   (ctx.job_id, user_id, email, ctx.attempt))


@app.task(queue="notify", key=lambda user_id, **_: f"user-{user_id}", retries=3,
          backoff=shardq.Exponential(base_s=0.1, cap_s=2))
async def send_notification(ctx, user_id: int, text: str) -> None:
    """An ``async def``: the worker awaits it on its event loop; the database work runs
    in the transaction's own thread."""
    if WORK_S:
        await asyncio.sleep(WORK_S)
    await ctx.db.execute("INSERT INTO notifications(job_id, user_id, text, attempt) VALUES (?, ?, ?, ?)",
                         (ctx.job_id, user_id, text, ctx.attempt))


@app.periodic(every_s=3600, queue="maintenance")
def hourly_report(ctx) -> None:
    """Fired once an hour by ``shardq serve`` when its config lists this module under
    ``service.schedule_modules``."""
    ctx.progress("report written")


def init_db(path: str) -> None:
    """Create the tables the tasks write to, in the idempotency store's file."""
    con = sqlite3.connect(path)
    try:
        con.executescript("""
            CREATE TABLE IF NOT EXISTS signups (job_id INTEGER, user_id INTEGER, email TEXT, attempt INTEGER);
            CREATE TABLE IF NOT EXISTS notifications (job_id INTEGER, user_id INTEGER, text TEXT, attempt INTEGER);
        """)
    finally:
        con.close()
