"""Receipt handles: a shardq lease, opaque and signed.

A handle carries the job id, the lease's fencing token, the queue (a CRC of its name) and
when it was received, MACed with a key kept in the data dir. So a handle cannot be forged or
moved to another queue, and an old delivery's handle holds an old token: the shard refuses it
(``LeaseLost``) once the message has been received again, so it never deletes or changes the
newer delivery.

The MAC is keyed BLAKE2b (version 2; RFC 7693's keyed mode is a MAC by design), 16 bytes: a
fifth of HMAC-SHA256's cost, and a receive of 10 and its delete make 20 of them. Handles of
version 1 (HMAC-SHA256, made before) are still taken, so a message received before an
upgrade can be deleted after it."""
from __future__ import annotations

import binascii
import hashlib
import hmac
import zlib
from functools import lru_cache
from typing import NamedTuple

import msgpack

from .faults import fault

_MAC_BYTES = 16
_VERSION = 2
_HMAC_VERSION = 1
_HANDLE_CHARS_MAX = 1024
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
_blake2b = hashlib.blake2b


class Receipt(NamedTuple):
    job_id: int
    token: int
    received_ms: int


@lru_cache(maxsize=1024)
def _queue_tag(queue: str) -> int:
    return zlib.crc32(queue.encode("utf-8"))


@lru_cache(maxsize=16)
def _keyed(key: bytes) -> hashlib.blake2b:
    """A BLAKE2b keyed with ``key``, made once: each MAC copies it (a copy costs half of
    keying a new one, which compresses the key block first)."""
    return _blake2b(digest_size=_MAC_BYTES, key=key)


def _mac(version: int, key: bytes, payload: bytes) -> bytes:
    if version == _HMAC_VERSION:
        return hmac.digest(key, payload, "sha256")[:_MAC_BYTES]
    h = _keyed(key).copy()
    h.update(payload)
    return h.digest()


def encode(key: bytes, queue: str, job_id: int, token: int, received_ms: int) -> str:
    payload = msgpack.packb([_VERSION, job_id, token, _queue_tag(queue), received_ms])
    raw = payload + _mac(_VERSION, key, payload)
    # base64url without padding (binascii directly: base64's wrappers cost as much again)
    return binascii.b2a_base64(raw, newline=False).translate(_TO_URLSAFE).rstrip(b"=").decode("ascii")


def decode(key: bytes, queue: str, handle: object) -> Receipt:
    """The lease behind ``handle``; ReceiptHandleIsInvalid for anything this service did not
    make for ``queue``."""
    if not isinstance(handle, str) or not 0 < len(handle) <= _HANDLE_CHARS_MAX:
        raise _bad(handle)
    try:
        text = handle.encode("ascii").translate(_FROM_URLSAFE)
        raw = binascii.a2b_base64(text + b"=" * (-len(text) % 4), strict_mode=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise _bad(handle) from None
    payload, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
    version = payload[1] if len(payload) > 1 else -1  # [fixarray, version (a positive fixint), ...]
    if len(raw) <= _MAC_BYTES or version not in (_VERSION, _HMAC_VERSION) \
            or not hmac.compare_digest(mac, _mac(version, key, payload)):
        raise _bad(handle)
    try:
        _, job_id, token, tag, received_ms = msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise _bad(handle) from None
    if tag != _queue_tag(queue):
        raise _bad(handle)
    return Receipt(job_id, token, received_ms)


def _bad(handle: object) -> Exception:
    return fault("ReceiptHandleIsInvalid", f"The input receipt handle \"{str(handle)[:100]}\" is not a valid "
                                           f"receipt handle.")
