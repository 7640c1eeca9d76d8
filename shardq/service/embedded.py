"""A service embedded in the calling process: ``shardq.open`` (:func:`open_service`) and
``shardq.App`` (:class:`App`: the tasks layer's App plus :meth:`App.embedded` and
:meth:`App.run_worker`, which run it all in this process).

Here, in the service layer, because starting the supervisor is the service's job and a
worker runs task jobs through their dispatcher: the tasks layer sits below both (the
scheduler and the workflow watcher use tasks; the dispatcher uses the App), so its App can
do neither without an import that points up or closes a cycle, and nothing inside the
package imports the ``shardq`` facade."""
from __future__ import annotations

import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from ..tasks import app as tasks_app

if TYPE_CHECKING:
    from ..client.router import Router


def open_service(data_dir: str, shards: int | None = None, config: Any = None, **router_options: Any) -> Router:
    """``shardq.open``: start the service in this process (supervisor thread + shard
    processes) and return a router to it; ``close()`` stops both."""
    # imported here: ``shardq.App`` in a worker or an app that only sends loads neither
    from ..client.router import Router
    from .supervisor import Supervisor
    sup = Supervisor(data_dir, config, shards).start(background=True)
    try:
        return Router(sup.dd.path, supervisor=sup, **router_options)
    except BaseException:
        sup.stop()
        raise


class App(tasks_app.App):
    """``shardq.App``: a set of tasks and the queue they are sent to (:class:`shardq.tasks.app.App`),
    which can also start a private service of its own (:meth:`embedded`) and run its tasks
    in this process (:meth:`run_worker`)."""

    @classmethod
    def embedded(cls, data_dir: str | None = None, shards: int = 1, config: Any = None) -> App:
        """An app with its own service (``shardq.open``) in ``data_dir`` (default: a new
        temp dir, removed by :meth:`close`). For tests and single-process programs."""
        owned = None
        if data_dir is None:
            owned = tempfile.mkdtemp(prefix="sqapp", dir="/tmp")  # short: unix socket paths
            data_dir = owned + "/data"
        try:
            app = cls(router=open_service(data_dir, shards=shards, config=config), config=config)
        except BaseException:
            if owned:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        app.target, app._owned_dir, app._owns_queue = data_dir, owned, True
        return app

    def run_worker(self, queue: str | None = None, *, until_idle: bool = True,
                   max_jobs: int | None = None, **worker_options: Any) -> Any:
        """Run this app's tasks in this process (tests): a :class:`~shardq.Worker` on
        ``queue`` (default: every queue of the app's tasks, one after the other) until
        it finds no more work. Returns the last worker's stats."""
        from ..consumer.worker import Worker
        from ..tasks.dispatch import TaskHandler
        handler = TaskHandler(self.tasks)
        queues = [queue] if queue else sorted({t.queue for t in self.tasks.values()})
        stats = None
        for q in queues:
            stats = Worker(self.queue, handler, queue=q, **worker_options).run(
                max_jobs=max_jobs, until_idle=until_idle)
        return stats
