"""Checks on request values, shared by the state machine, the router and the CLI.

Each function returns the normalised value or raises :class:`~shardq.errors.InvalidJob`
naming the field. Nothing here mutates state.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from .. import limits
from ..errors import InvalidJob


def body(value: object, max_bytes: int) -> bytes:
    if type(value) is bytes:
        data = value
    elif isinstance(value, (bytearray, memoryview)):
        data = bytes(value)
    else:
        raise InvalidJob(f"body must be bytes, got {type(value).__name__}")
    if not data:
        raise InvalidJob("body must not be empty")
    if len(data) > max_bytes:
        raise InvalidJob(f"body is {len(data)} bytes, over the queue's limit of {max_bytes}")
    return data


def key(value: object) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        raise InvalidJob(f"key must be a string or None, got {type(value).__name__}")
    if not value:
        raise InvalidJob("key must not be empty (leave the key out for a keyless job)")
    if len(value) * 4 > limits.KEY_BYTES_MAX and len(_utf8("key", value)) > limits.KEY_BYTES_MAX:
        raise InvalidJob(f"key is over {limits.KEY_BYTES_MAX} bytes (UTF-8)")
    return value


def seconds(name: str, value: object, *, hi: float, lo: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidJob(f"{name} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < lo or value > hi or (positive and value <= 0):
        bound = "> 0" if positive else f">= {lo}"
        raise InvalidJob(f"{name} must be {bound} and <= {hi}, got {value!r}")
    return float(value)


def priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJob(f"priority must be an integer, got {value!r}")
    if not limits.PRIORITY_MIN <= value <= limits.PRIORITY_MAX:
        raise InvalidJob(f"priority must be within [{limits.PRIORITY_MIN}, {limits.PRIORITY_MAX}]")
    return value


def dedup_id(value: object) -> str | bytes | None:
    if value is None:
        return None
    if not isinstance(value, (str, bytes)) or not value:
        raise InvalidJob(f"dedup_id must be a non-empty string, got {value!r}")
    if len(value) > limits.DEDUP_ID_BYTES_MAX or (type(value) is str and len(value) * 4 > limits.DEDUP_ID_BYTES_MAX
                                                  and len(_utf8("dedup_id", value)) > limits.DEDUP_ID_BYTES_MAX):
        raise InvalidJob(f"dedup_id is over {limits.DEDUP_ID_BYTES_MAX} bytes (UTF-8)")
    return value


def _utf8(name: str, value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJob(f"{name} is not valid text (it holds a lone surrogate)") from None


def count(name: str, value: object, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise InvalidJob(f"{name} must be an integer in [1, {hi}], got {value!r}")
    return value


def integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**63:
        raise InvalidJob(f"{name} must be an integer in [0, 2**63 - 1], got {value!r:.40}")
    return value


def error_text(value: object) -> str | None:
    """The error, cut to ``limits.ERROR_TEXT_BYTES_MAX`` UTF-8 bytes (a whole character at most
    is dropped at the cut)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidJob(f"error must be a string, got {type(value).__name__}")
    if len(value) * 4 <= limits.ERROR_TEXT_BYTES_MAX:
        return value
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) <= limits.ERROR_TEXT_BYTES_MAX:
        return value
    return raw[: limits.ERROR_TEXT_BYTES_MAX].decode("utf-8", "ignore")


def job_bytes(body: bytes, key: str | None, queue: str, dedup_id: str | bytes | None = None,
              error: str | None = None) -> int:
    """An upper bound of one job's encoding in a frame or log record (see
    ``limits.JOB_FIXED_BYTES_MAX``), computed without encoding it."""
    return (len(body) + 4 * (len(key or "") + len(queue) + len(error or "")) + len(dedup_id or "") * 4
            + limits.JOB_FIXED_BYTES_MAX)


_BODY, _KEY, _QUEUE, _DEDUP_ID = (operator.itemgetter(i) for i in (0, 1, 2, 5))


def jobs_bytes(items: Sequence[Sequence[Any]]) -> int:
    """The sum of :func:`job_bytes` over checked wire items ``(body, key, queue, _, _,
    dedup_id, ...)``, exactly, with no Python step per item: a batch of many jobs is
    measured by C loops (``map``), not by a call per job."""
    return (len(items) * limits.JOB_FIXED_BYTES_MAX + sum(map(len, map(_BODY, items)))
            + 4 * (sum(map(len, filter(None, map(_KEY, items)))) + sum(map(len, map(_QUEUE, items)))
                   + sum(map(len, filter(None, map(_DEDUP_ID, items))))))
