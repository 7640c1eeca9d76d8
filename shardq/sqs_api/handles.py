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
from collections.abc import Callable
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
_b2a, _a2b = binascii.b2a_base64, binascii.a2b_base64


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
    return encoder(key, queue)(job_id, token, received_ms)


def encoder(key: bytes, queue: str) -> Callable[[int, int, int], str]:
    """:func:`encode` for one key and queue, as ``encode(job_id, token, received_ms)``: what
    is the same for every handle of a receive (the queue's tag, the keyed MAC, a packer) made
    once."""
    tag, keyed, pack = _queue_tag(queue), _keyed(key), msgpack.Packer().pack

    def encode(job_id: int, token: int, received_ms: int) -> str:
        payload = pack([_VERSION, job_id, token, tag, received_ms])
        h = keyed.copy()
        h.update(payload)
        # base64url without padding (binascii directly: base64's wrappers cost as much again)
        return _b2a(payload + h.digest(), newline=False).translate(_TO_URLSAFE).rstrip(b"=").decode("ascii")
    return encode


def decode(key: bytes, queue: str, handle: object) -> Receipt:
    """The lease behind ``handle``; ReceiptHandleIsInvalid for anything this service did not
    make for ``queue``."""
    return Receipt(*decoder(key, queue)(handle))


def decoder(key: bytes, queue: str) -> Callable[[object], tuple[int, int, int]]:
    """:func:`decode` for one key and queue, as ``decode(handle) -> (job_id, token,
    received_ms)``: the queue's tag and the keyed MAC made once for a batch's handles."""
    tag, keyed = _queue_tag(queue), _keyed(key)

    def decode(handle: object) -> tuple[int, int, int]:
        if not isinstance(handle, str) or not 0 < len(handle) <= _HANDLE_CHARS_MAX:
            raise _bad(handle)
        try:
            text = handle.encode("ascii").translate(_FROM_URLSAFE)
            raw = _a2b(text + b"=" * (-len(text) % 4), strict_mode=True)
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise _bad(handle) from None
        payload, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        version = payload[1] if len(payload) > 1 else -1  # [fixarray, version (a positive fixint), ...]
        if version == _VERSION:
            h = keyed.copy()
            h.update(payload)
            expected = h.digest()
        elif version == _HMAC_VERSION:
            expected = _mac(version, key, payload)
        else:
            raise _bad(handle)
        if not hmac.compare_digest(mac, expected):  # (a known version: longer than the MAC)
            raise _bad(handle)
        try:
            _, job_id, token, got_tag, received_ms = msgpack.unpackb(payload)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise _bad(handle) from None
        if got_tag != tag:
            raise _bad(handle)
        return job_id, token, received_ms
    return decode


def _bad(handle: object) -> Exception:
    return fault("ReceiptHandleIsInvalid", f"The input receipt handle \"{str(handle)[:100]}\" is not a valid "
                                           f"receipt handle.")
