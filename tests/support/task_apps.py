"""A shared task app between tests: each test gets it with no tasks and leaves its queues
empty (tests/tasks, tests/service); and an embedded app with the HTTP listener of ``shardq
serve`` on it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import shardq


@contextlib.contextmanager
def fresh_tasks(app) -> Iterator:
    """``app`` with its tasks cleared; afterwards its tasks cleared again and every queue
    emptied: what is ready is leased and acked (so no key stays held by a lease), and the
    dead letters are purged."""
    app.tasks.clear()
    try:
        yield app
    finally:
        app.tasks.clear()
        q = app.queue
        for name in list(q.stats()["queues"]):
            while leases := q.dequeue_many(name, max_jobs=1000):
                q.ack_many(leases)
            q.purge_dead_letters(name)


def jobs_held(app) -> int:
    """Every job the app's service holds now, in any state (dead letters too)."""
    queues = app.queue.stats()["queues"]
    return sum(q["ready"] + q["delayed"] + q["waiting"] + q["in_flight"] + q["dead"] for q in queues.values())


def drain(app, queue: str = "default", **kw):
    """Run ``app``'s tasks of ``queue`` in this process until it is empty (``run_worker``,
    with the short idle wait and poll that tests want); its summary."""
    return app.run_worker(queue, idle_wait_s=0.05, poll_s=0.01, **kw)


@contextlib.contextmanager
def embedded_with_http(token: str, config: dict, shards: int = 2) -> Iterator:
    """``shardq.App.embedded`` with the HTTP listener (console, API, metrics) on a free
    loopback port, ``app.url``, bearer ``token``; both stopped afterwards."""
    import shardq
    from shardq.config import HttpConfig
    from shardq.service.http_server import HttpService
    app = shardq.App.embedded(shards=shards, config=config)
    try:
        http = HttpService(app.target, HttpConfig(listen="127.0.0.1:0", token=token)).start()
        try:
            app.url = http.url
            yield app
        finally:
            http.stop()
    finally:
        app.close()


def make_app(q) -> tuple[shardq.App, object, object]:
    """An app on ``q`` with a task that keeps its result (``kept``) and one that does not
    (``plain``, returns its argument)."""
    app = shardq.App(router=q)

    @app.task(keep_result=60)
    def kept(ctx) -> int:
        return 1

    @app.task
    def plain(ctx, x: int = 0) -> int:
        return x
    return app, kept, plain
