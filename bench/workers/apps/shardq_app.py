"""shardq: the handler ``shardq worker bench.workers.apps.shardq_app:noop`` runs, and the
enqueue, ``Router.enqueue`` once per job (no key: the jobs need no order, as with the other
frameworks).

The workflows figure (``bench/workflows.py``) runs this module's tasks instead, with
``shardq worker bench.workers.apps.shardq_app`` (no colon: every task of ``wf``): the no-op
as a task, sent as plain jobs and as a chord's members, and the chord's callback. Figure Wk
names the handler, so the tasks are not run there."""
from __future__ import annotations

import os

import shardq

from ..record import record
from . import SHARDQ_DIR_ENV


def noop(ctx) -> None:
    record(ctx.body.decode())


def enqueue_all(ids: list[str]) -> None:
    with shardq.connect(os.environ[SHARDQ_DIR_ENV]) as q:
        for job_id in ids:
            q.enqueue(job_id.encode())


# The workflows figure: an App as a user writes one (connects on the first send).
wf = shardq.App(os.environ[SHARDQ_DIR_ENV])


@wf.task(name="bench.wf.noop")
def wf_noop(ctx, job_id: str) -> None:
    record(job_id)


@wf.task(name="bench.wf.done")
def wf_done(ctx, results: list, job_id: str) -> int:
    """The chord's callback: records that it ran, returns how many member values it got."""
    record(job_id)
    return len(results)
