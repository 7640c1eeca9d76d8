"""The SQS API's catalog in a backup: ``<data dir>/sqs-api/catalog.json``.

It holds the SQS queues, their attributes and tags, the key that signs receipt handles,
purge times and message move tasks (docs/sqs-api.md, "Shared and durable"); without it a
restored service has the messages but not their queues, and every outstanding receipt
handle is refused. Only that file is state: ``catalog.lock`` and ``owners/`` (one lock
file per live process) are made again by the processes that serve the restored copy, and
a task whose owner is not among them is listed ``FAILED``, as after a restart.

The catalog is written by :mod:`shardq.sqs_api.catalog`, a layer above this one: its path
and the fields a restored service reads at start are named here, not imported
(``tests/backup/test_sqs_catalog.py`` checks that both name the same file).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from ..errors import CorruptLog

#: The catalog's path in a data dir and in a backup ("/"-separated).
PATH = "sqs-api/catalog.json"
VERSION = 1
_KEY = re.compile(r"[0-9a-f]{64}")


def snapshot(data_dir: str) -> bytes | None:
    """The catalog of ``data_dir`` as it is on disk now, or None if the SQS API never ran
    there. Consistent without its lock: every change writes a new file and renames it over
    the old one, so one open and read sees one whole version. CorruptLog naming the file
    if it is not a catalog (:func:`check`)."""
    path = os.path.join(data_dir, PATH)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    check(path, data)
    return data


def check(path: str, data: bytes) -> None:
    """CorruptLog naming ``path`` unless ``data`` is a catalog this shardq starts on: JSON
    of version 1 with its handle key (64 hex digits) and its tables of queues, deleted
    queues and move tasks."""
    try:
        doc: Any = json.loads(data)
    except ValueError as e:
        raise CorruptLog(path, 0, f"not an SQS API catalog: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise CorruptLog(path, 0, f"not an SQS API catalog of version {VERSION}: {data[:80]!r}")
    key = doc.get("key")
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise CorruptLog(path, 0, "an SQS API catalog without its receipt handle key (64 hex digits)")
    bad = [name for name in ("queues", "deleted", "tasks") if not isinstance(doc.get(name), dict)]
    if bad:
        raise CorruptLog(path, 0, f"an SQS API catalog without its table of {bad[0]}")
