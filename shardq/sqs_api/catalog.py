"""The queues the SQS API knows: attributes, tags, times, durable in the data dir and
shared by every process that serves the SQS API on it.

One JSON file, ``<data dir>/sqs-api/catalog.json``, rewritten whole on every change: written
to a temporary file, fsynced, renamed over the old one, the directory fsynced. So a change
is answered only once it is on disk, and a crash leaves the old file or the new one, never
half of either. Changes are rare (queue creation, attributes, tags, purges, move tasks).

Several processes may hold a catalog of one data dir: a change takes an exclusive
``flock`` on ``catalog.lock``, reads the file again if another process replaced it, applies
itself and writes, so no change overwrites another's. A read looks at the file's identity
(one ``stat``) and reads it again only if it was replaced. The key that signs receipt
handles (:mod:`.handles`) is made at first start, under the lock, so every process signs
with the same one.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..clock import Clock, SystemClock
from .attributes import redrive_target
from .faults import fault

FILE = "catalog.json"
LOCK = "catalog.lock"
DIR = "sqs-api"
OWNERS = "owners"          # one flock'd file per live process that runs message move tasks
DELETED_RECENTLY_S = 60.0  # AWS: a deleted queue's name may be used again after 60 s
TASKS_KEPT = 10            # ended message move tasks kept per source queue
INCARNATION_BYTES = 6      # a queue record's random "incarnation": 12 hex characters


class Catalog:
    """Thread-safe and process-safe; each method that changes something returns once it is
    durable."""

    def __init__(self, data_dir: str, clock: Clock | None = None):
        self.clock = clock or SystemClock()
        self.dir = os.path.join(data_dir, DIR)
        self.path = os.path.join(self.dir, FILE)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime ns, size) of the file read
        self._data: dict[str, Any] = {}
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        weakref.finalize(self, os.close, self._lock_fd)
        with self._changing():  # first start: one process makes the file (and the key), under the lock
            pass
        self.key = bytes.fromhex(self._data["key"])

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _refresh(self) -> None:
        """Read the file again if another process replaced it since (caller holds _lock)."""
        seen = self._identity()
        if seen is not None and seen == self._seen:
            return
        if seen is None:
            if self._seen is None:  # first start, under the flock (_changing)
                fresh: dict[str, Any] = {"version": 1, "key": secrets.token_hex(32), "queues": {}, "deleted": {},
                                         "tasks": {}}
                self._write(fresh)
                self._data, self._seen = fresh, self._identity()
            return  # removed under us: keep what we have
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())  # of the file read, which may be newer than the stat above
            self._data = json.load(f)
        self._seen = st.st_ino, st.st_mtime_ns, st.st_size

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold this process's lock and the file's flock, with the latest file read."""
        with self._lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                self._refresh()
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        """The latest catalog (caller holds _lock)."""
        self._refresh()
        return self._data

    def _commit(self, **tables: Any) -> None:
        """Make ``tables`` (new top-level values) durable, then current: a write that fails
        (disk full) leaves the catalog as it was, in memory and on disk. Caller is in
        :meth:`_changing`."""
        new = dict(self._data, **tables)
        self._write(new)
        self._data = new
        self._seen = self._identity()

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
        """The queue's record (``attributes``, ``tags``, ``created``, ``modified``, and
        ``incarnation``: random, made by the CreateQueue that made the queue; absent from a
        record made before shardq had it), not to be changed: a change replaces a record's
        dicts instead of changing them, so a record read once stays whole (read on every
        request: no copy).

        Without the lock while the file is the one read last (one ``stat``): every request
        takes this path, and request threads queued on the lock cost a thread switch each.
        ``_data`` is replaced before ``_seen``, so a ``_seen`` that matches the file comes
        with the data read from it."""
        seen = self._identity()
        if seen is not None and seen == self._seen:
            fresh: dict[str, Any] | None = self._data["queues"].get(name)
            return fresh
        with self._lock:
            q: dict[str, Any] | None = self._read()["queues"].get(name)
            return q

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._read()["queues"])

    def sources_of(self, dlq_arn: str) -> list[str]:
        """Queues whose RedrivePolicy names ``dlq_arn``, by name."""
        with self._lock:
            return sorted(n for n, q in self._read()["queues"].items()
                          if redrive_target(q["attributes"]) == dlq_arn)

    # ------------------------------------------------------------------ changes
    def create(self, name: str, attributes: dict[str, str], given: dict[str, str], tags: dict[str, str]) -> bool:
        """Create the queue; False if it exists with these attributes already (AWS answers
        its URL), QueueNameExists if ``given`` (the attributes the request named) differ from
        its own, QueueDeletedRecently within 60 s of its deletion."""
        now = self.clock.now()
        with self._changing():
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
            # the incarnation tells this queue from an earlier one of its name (FIFO dedup ids, memos)
            record = {"attributes": attributes, "tags": tags, "created": int(now), "modified": int(now),
                      "incarnation": secrets.token_hex(INCARNATION_BYTES)}
            self._commit(queues={**self._data["queues"], name: record}, deleted=deleted)
            return True

    def delete(self, name: str) -> None:
        with self._changing():
            self._queue(name)
            self._commit(queues={n: q for n, q in self._data["queues"].items() if n != name},
                         deleted={**self._data["deleted"], name: self.clock.now()})

    def set_attributes(self, name: str, attributes: dict[str, str],
                       check: Callable[[dict[str, str]], None] | None = None) -> None:
        """Set attributes of ``name``; ``check`` (if given) is called with the attributes as
        they would be, under the lock, and may refuse them by raising."""
        with self._changing():
            q = self._queue(name)
            merged = {**q["attributes"], **attributes}
            if check is not None:
                check(merged)
            record = dict(q, attributes=merged, modified=int(self.clock.now()))
            self._commit(queues={**self._data["queues"], name: record})

    def set_tags(self, name: str, add: dict[str, str], remove: list[str], max_tags: int) -> None:
        with self._changing():
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

    def stamp_purge(self, name: str, every_s: float) -> None:
        """Note a PurgeQueue of ``name`` now; PurgeQueueInProgress if one was noted within
        ``every_s`` (by any process). Noted before the purge runs: a crash between the two
        refuses a retry for a while, where the other order could let a retry delete messages
        sent after the first purge."""
        now = self.clock.now()
        with self._changing():
            self._queue(name)
            purged = self._data.get("purged", {})
            last = purged.get(name)
            if last is not None and 0 <= now - last < every_s:
                raise fault("PurgeQueueInProgress", f"Only one PurgeQueue operation on {name} is allowed every "
                                                    f"{every_s:.0f} seconds.")
            kept = {n: t for n, t in purged.items() if now - t < every_s and n in self._data["queues"]}
            self._commit(purged={**kept, name: now})

    def note_first_receives(self, name: str) -> bool:
        """Mark the queue as one whose first receives are remembered (a receive asked for
        ApproximateFirstReceiveTimestamp); True if it was not marked yet."""
        with self._changing():
            q = self._queue(name)
            if q.get("first_receives"):
                return False
            self._commit(queues={**self._data["queues"], name: dict(q, first_receives=True)})
            return True

    # ------------------------------------------------------------------ message move tasks
    def tasks(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            tasks: dict[str, dict[str, Any]] = copy.deepcopy(self._read()["tasks"])
            return tasks

    def put_task(self, handle: str, task: dict[str, Any]) -> None:
        with self._changing():
            self._put_task(handle, task)

    def start_task(self, handle: str, task: dict[str, Any], active: tuple[str, ...]) -> bool:
        """Add ``task`` unless a task of its source is in one of the ``active`` states (in
        one step under the flock: two processes cannot both start one); False if one is."""
        with self._changing():
            if any(t["SourceArn"] == task["SourceArn"] and t["Status"] in active
                   for t in self._data["tasks"].values()):
                return False
            self._put_task(handle, task)
            return True

    def update_task(self, handle: str, only_if: tuple[str, ...] = (), **fields: Any) -> dict[str, Any] | None:
        """Change fields of a task in one step (read, change, write under the flock); None if
        there is no such task, or its status is not one of ``only_if`` (when given)."""
        with self._changing():
            task = self._data["tasks"].get(handle)
            if task is None or (only_if and task["Status"] not in only_if):
                return None
            task = dict(task, **fields)
            self._put_task(handle, task)
            return copy.deepcopy(task)

    def _put_task(self, handle: str, task: dict[str, Any]) -> None:
        tasks = {**self._data["tasks"], handle: task}
        ended = sorted((t["StartedTimestamp"], h) for h, t in tasks.items()
                       if t["SourceArn"] == task["SourceArn"] and t["Status"] not in ("RUNNING", "CANCELLING"))
        for _, old in ended[:-TASKS_KEPT]:  # AWS lists the last 10 of a source
            del tasks[old]
        self._commit(tasks=tasks)


class Owner:
    """This process, as the runner of message move tasks: a file in ``sqs-api/owners/``
    held with an exclusive ``flock`` while the process lives. The kernel drops the lock
    when the process dies, however it dies, so another process can tell a task whose
    runner is gone (:func:`alive`) from one that runs elsewhere."""

    def __init__(self, catalog_dir: str):
        self.dir = os.path.join(catalog_dir, OWNERS)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.id = secrets.token_hex(8)
        self._fd = os.open(os.path.join(self.dir, self.id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, self.id))
            os.close(self._fd)
            self._fd = -1


def alive(catalog_dir: str, owner: str | None) -> bool:
    """Whether the process ``owner`` (an :class:`Owner` id) still runs; its file is removed
    if not."""
    if not owner or "/" in owner or owner.startswith("."):
        return False
    path = os.path.join(catalog_dir, OWNERS, owner)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)
