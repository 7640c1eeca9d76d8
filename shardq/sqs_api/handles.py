"""Receipt handles: a shardq lease, opaque and signed.

A handle carries the job id, the lease's fencing token, the queue (a CRC of its name) and
when it was received, MACed with a key kept in the data dir. So a handle cannot be forged or
moved to another queue, and an old delivery's handle holds an old token: the shard refuses it
(``LeaseLost``) once the message has been received again, so it never deletes or changes the
newer delivery."""
from __future__ import annotations

import base64
import binascii
import hmac
import zlib
from typing import NamedTuple

import msgpack

from .faults import fault

_MAC_BYTES = 16
_VERSION = 1


class Receipt(NamedTuple):
    job_id: int
    token: int
    received_ms: int


def _queue_tag(queue: str) -> int:
    return zlib.crc32(queue.encode("utf-8"))


def encode(key: bytes, queue: str, job_id: int, token: int, received_ms: int) -> str:
    payload = msgpack.packb([_VERSION, job_id, token, _queue_tag(queue), received_ms])
    mac = hmac.digest(key, payload, "sha256")[:_MAC_BYTES]
    return base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")


def decode(key: bytes, queue: str, handle: object) -> Receipt:
    """The lease behind ``handle``; ReceiptHandleIsInvalid for anything this service did not
    make for ``queue``."""
    bad = fault("ReceiptHandleIsInvalid", f"The input receipt handle \"{str(handle)[:100]}\" is not a valid "
                                          f"receipt handle.")
    if not isinstance(handle, str) or not 0 < len(handle) <= 1024:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    except (binascii.Error, ValueError):
        raise bad from None
    payload, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
    good = hmac.digest(key, payload, "sha256")[:_MAC_BYTES]
    if len(raw) <= _MAC_BYTES or not hmac.compare_digest(mac, good):
        raise bad
    try:
        version, job_id, token, tag, received_ms = msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise bad from None
    if version != _VERSION or tag != _queue_tag(queue):
        raise bad
    return Receipt(job_id, token, received_ms)
