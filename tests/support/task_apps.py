"""A shared task app between tests: each test gets it with no tasks and leaves its queues
empty (tests/tasks, tests/service)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
