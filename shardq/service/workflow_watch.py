"""The service's workflow watcher: records how each workflow ends (docs/design.md,
"Workflow records").

A workflow's jobs and barriers live on many shards, and no shard sees the whole: the
watcher, one thread of the service, does. Every ``WATCH_S`` it lists the running records
of every shard, loads each workflow and computes its state from its jobs and barriers
(:meth:`~shardq.tasks.workflow.Workflow.outcome`: the same reading ``wf.result()`` makes,
a few calls per workflow, not one per member); one that ended gets its end recorded on its
home shard (``end_workflow``), which counts it succeeded, failed or cancelled (a step's
job gone before it reported, cancelled or purged, reads as cancelled; a record that says
``failed`` keeps it: a record keeps its first end). So a workflow's record says how it
ended within about ``WATCH_S`` of its last step, whoever sent it and whether or not
anyone waits for its result. A shard that is down is skipped
until it is back; a record this version cannot read is logged once and left running.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from ..errors import InvalidJob, NotFound, ShardqError

if TYPE_CHECKING:
    from ..client.router import Router

log = logging.getLogger("shardq.service")

#: How often the watcher looks at the running workflows.
WATCH_S = 1.0
#: Records listed per call (a shard holding more is listed page by page).
PAGE = 1000


class WorkflowWatcher:
    """Looks at the running workflows every ``every_s`` (see the module docstring), on the
    shards ``shards()`` names (the supervisor's: those whose last pong counted running
    records), through a router of the service's own, opened on the first look that needs
    one and closed by :meth:`stop`. ``target``: the data dir, or an open router (tests)."""

    def __init__(self, target: str | os.PathLike[str] | Router, shards: Callable[[], Collection[int]] | None = None,
                 every_s: float = WATCH_S):
        self._target = target
        self.router: Router | None = None if isinstance(target, (str, os.PathLike)) else target
        self._shards = shards
        self.every_s = every_s
        self.ended = 0                      # ends recorded since it started
        self._stop = threading.Event()
        self._unreadable: set[str] = set()  # logged once each
        self._thread: threading.Thread | None = None

    def start(self) -> WorkflowWatcher:
        self._thread = threading.Thread(target=self._loop, name="shardq-workflow-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self.router is not None and self.router is not self._target:
            self.router.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.run_once()
            except Exception:  # never let one bad look end the watcher
                log.exception("event=workflow-watch-error")

    def run_once(self) -> int:
        """One look at every running workflow; returns how many ends it recorded."""
        from ..tasks.workflow import RECORD_KEPT_S, Workflow
        shards = self._shards() if self._shards is not None else None
        if shards is not None and not shards:
            return 0  # no shard holds a running workflow: nothing to connect for
        if self.router is None:
            from ..client.router import Router
            self.router = Router(self._target, _role="service")  # type: ignore[arg-type]  # a path: else router is set
        ended = 0
        for shard in range(self.router.shards) if shards is None else shards:
            after = None
            while not self._stop.is_set():
                try:
                    ids = self.router.workflow_ids(shard, after, PAGE)
                except ShardqError as exc:  # down: looked at again next time
                    log.debug("workflow watch: shard %d: %s", shard, exc)
                    break
                for wf_id in ids:
                    try:
                        outcome = Workflow.load(self.router, wf_id).outcome()
                        if outcome is not None:
                            self.router.end_workflow(wf_id, outcome[0], outcome[1], RECORD_KEPT_S)
                            ended += 1
                    except InvalidJob as exc:
                        if wf_id not in self._unreadable:
                            self._unreadable.add(wf_id)
                            log.warning("event=workflow-unreadable id=%s error=%s", wf_id, exc)
                    except NotFound:
                        pass  # ended and expired meanwhile
                    except ShardqError as exc:  # a shard of its steps is down: next time
                        log.debug("workflow watch: %s: %s", wf_id, exc)
                if len(ids) < PAGE:
                    break
                after = ids[-1]
        self.ended += ended
        return ended
