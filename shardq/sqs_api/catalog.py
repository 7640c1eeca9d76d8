"""The queues the SQS API knows: attributes, tags, times, durable in the data dir.

One JSON file, ``<data dir>/sqs-api/catalog.json``, rewritten whole on every change: written
to a temporary file, fsynced, renamed over the old one, the directory fsynced. So a change
is answered only once it is on disk, and a crash leaves the old file or the new one, never
half of either. Changes are rare (queue creation, attributes, tags); reads come from memory.
It also keeps the key that signs receipt handles (:mod:`.handles`), made at first start.
"""
from __future__ import annotations

import copy
import json
import os
import secrets
import threading
from typing import Any

from ..clock import Clock, SystemClock
from .faults import fault

FILE = "catalog.json"
DIR = "sqs-api"
DELETED_RECENTLY_S = 60.0  # AWS: a deleted queue's name may be used again after 60 s
TASKS_KEPT = 10            # ended message move tasks kept per source queue


class Catalog:
    """Thread-safe; each method that changes something returns once it is durable."""

    def __init__(self, data_dir: str, clock: Clock | None = None):
        self.clock = clock or SystemClock()
        self.dir = os.path.join(data_dir, DIR)
        self.path = os.path.join(self.dir, FILE)
        self._lock = threading.Lock()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        try:
            with open(self.path, "rb") as f:
                self._data = json.load(f)
        except FileNotFoundError:
            fresh = {"version": 1, "key": secrets.token_hex(32), "queues": {}, "deleted": {}, "tasks": {}}
            self._write(fresh)
            self._data = fresh
        self.key = bytes.fromhex(self._data["key"])

    def _commit(self, **tables: Any) -> None:
        """Make ``tables`` (new top-level values) durable, then current: a write that fails
        (disk full) leaves the catalog as it was, in memory and on disk."""
        new = dict(self._data, **tables)
        self._write(new)
        self._data = new

    def _write(self, data: dict[str, Any]) -> None:
        tmp = self.path + ".tmp"
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ------------------------------------------------------------------ reads
    def get(self, name: str) -> dict[str, Any] | None:
        """The queue's record (``attributes``, ``tags``, ``created``, ``modified``), not to be
        changed: a change replaces a record's dicts instead of changing them, so a record
        read once stays whole (read on every request: no copy)."""
        with self._lock:
            q: dict[str, Any] | None = self._data["queues"].get(name)
            return q

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._data["queues"])

    def sources_of(self, dlq_arn: str) -> list[str]:
        """Queues whose RedrivePolicy names ``dlq_arn``, by name."""
        with self._lock:
            return sorted(n for n, q in self._data["queues"].items()
                          if dlq_arn in q["attributes"].get("RedrivePolicy", ""))

    # ------------------------------------------------------------------ changes
    def create(self, name: str, attributes: dict[str, str], given: dict[str, str], tags: dict[str, str]) -> bool:
        """Create the queue; False if it exists with these attributes already (AWS answers
        its URL), QueueNameExists if ``given`` (the attributes the request named) differ from
        its own, QueueDeletedRecently within 60 s of its deletion."""
        now = self.clock.now()
        with self._lock:
            q = self._data["queues"].get(name)
            if q is not None:
                differ = [k for k, v in given.items() if q["attributes"].get(k) != v]
                if differ:
                    raise fault("QueueNameExists", f"A queue already exists with the same name and a different "
                                                   f"value for attribute {differ[0]}")
                return False
            gone = self._data["deleted"].get(name)
            if gone is not None and now - gone < DELETED_RECENTLY_S:
                raise fault("QueueDeletedRecently", "You must wait 60 seconds after deleting a queue before you "
                                                    "can create another queue with the same name.")
            deleted = {n: t for n, t in self._data["deleted"].items() if now - t < DELETED_RECENTLY_S and n != name}
            record = {"attributes": attributes, "tags": tags, "created": int(now), "modified": int(now)}
            self._commit(queues={**self._data["queues"], name: record}, deleted=deleted)
            return True

    def delete(self, name: str) -> None:
        with self._lock:
            self._queue(name)
            self._commit(queues={n: q for n, q in self._data["queues"].items() if n != name},
                         deleted={**self._data["deleted"], name: self.clock.now()})

    def set_attributes(self, name: str, attributes: dict[str, str]) -> None:
        with self._lock:
            q = self._queue(name)
            record = dict(q, attributes={**q["attributes"], **attributes}, modified=int(self.clock.now()))
            self._commit(queues={**self._data["queues"], name: record})

    def set_tags(self, name: str, add: dict[str, str], remove: list[str], max_tags: int) -> None:
        with self._lock:
            q = self._queue(name)
            tags = dict(q["tags"])
            tags.update(add)
            for k in remove:
                tags.pop(k, None)
            if len(tags) > max_tags:
                raise fault("InvalidParameterValue", f"Too many tags: a queue has at most {max_tags}.")
            self._commit(queues={**self._data["queues"], name: dict(q, tags=tags)})

    def _queue(self, name: str) -> dict[str, Any]:
        q: dict[str, Any] | None = self._data["queues"].get(name)
        if q is None:
            raise fault("QueueDoesNotExist", "The specified queue does not exist.")
        return q

    # ------------------------------------------------------------------ message move tasks
    def tasks(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            tasks: dict[str, dict[str, Any]] = copy.deepcopy(self._data["tasks"])
            return tasks

    def put_task(self, handle: str, task: dict[str, Any]) -> None:
        with self._lock:
            tasks = {**self._data["tasks"], handle: task}
            ended = sorted((t["StartedTimestamp"], h) for h, t in tasks.items()
                           if t["SourceArn"] == task["SourceArn"] and t["Status"] not in ("RUNNING", "CANCELLING"))
            for _, old in ended[:-TASKS_KEPT]:  # AWS lists the last 10 of a source
                del tasks[old]
            self._commit(tasks=tasks)
