"""A service embedded in the calling process: ``shardq.open`` (:func:`open_service`) and
``shardq.App`` (:class:`App`, the tasks layer's App plus :meth:`App.embedded`).

Here, in the service layer, because starting the supervisor is the service's job: the tasks
layer sits below it (the scheduler and the workflow watcher use tasks), so its App cannot
start a service itself, and nothing inside the package imports the ``shardq`` facade."""
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
    which can also start a private service of its own (:meth:`embedded`)."""

    @classmethod
    def embedded(cls, data_dir: str | None = None, shards: int = 1, config: Any = None) -> App:
        """An app with its own service (``shardq.open``) in ``data_dir`` (default: a new
        temp dir, removed by :meth:`close`). For tests and single-process programs."""
        owned = None
        if data_dir is None:
            owned = tempfile.mkdtemp(prefix="sqapp", dir="/tmp")  # short: unix socket paths
            data_dir = owned + "/data"
        try:
            # (Router is not yet a Queue to mypy: its ids are list[int], the protocol's list[int | str],
            # and a list is invariant; the client's to settle)
            app = cls(router=open_service(data_dir, shards=shards, config=config))  # type: ignore[arg-type]
        except BaseException:
            if owned:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        app.target, app._owned_dir, app._owns_queue = data_dir, owned, True
        return app
