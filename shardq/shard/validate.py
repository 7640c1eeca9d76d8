"""Checks on request values, shared by the state machine, the router and the CLI.

Each function returns the normalised value or raises :class:`~shardq.errors.InvalidJob`
naming the field. Nothing here mutates state.
"""
from __future__ import annotations

import math

from .. import limits
from ..errors import InvalidJob


def body(value, max_bytes: int) -> bytes:
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        else:
            raise InvalidJob(f"body must be bytes, got {type(value).__name__}")
    if not value:
        raise InvalidJob("body must not be empty")
    if len(value) > max_bytes:
        raise InvalidJob(f"body is {len(value)} bytes, over the queue's limit of {max_bytes}")
    return value


def key(value) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        raise InvalidJob(f"key must be a string or None, got {type(value).__name__}")
    if not value:
        raise InvalidJob("key must not be empty (leave the key out for a keyless job)")
    if len(value) * 4 > limits.KEY_BYTES_MAX and len(value.encode()) > limits.KEY_BYTES_MAX:
        raise InvalidJob(f"key is over {limits.KEY_BYTES_MAX} bytes")
    return value


def seconds(name: str, value, *, hi: float, lo: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidJob(f"{name} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < lo or value > hi or (positive and value <= 0):
        bound = "> 0" if positive else f">= {lo}"
        raise InvalidJob(f"{name} must be {bound} and <= {hi}, got {value!r}")
    return float(value)


def priority(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJob(f"priority must be an integer, got {value!r}")
    if not limits.PRIORITY_MIN <= value <= limits.PRIORITY_MAX:
        raise InvalidJob(f"priority must be within [{limits.PRIORITY_MIN}, {limits.PRIORITY_MAX}]")
    return value


def dedup_id(value) -> str | bytes | None:
    if value is None:
        return None
    if not isinstance(value, (str, bytes)) or not value:
        raise InvalidJob(f"dedup_id must be a non-empty string, got {value!r}")
    if len(value) > limits.DEDUP_ID_BYTES_MAX:
        raise InvalidJob(f"dedup_id is over {limits.DEDUP_ID_BYTES_MAX} characters")
    return value


def count(name: str, value, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise InvalidJob(f"{name} must be an integer in [1, {hi}], got {value!r}")
    return value


def integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**63:
        raise InvalidJob(f"{name} must be a non-negative integer, got {value!r}")
    return value


def error_text(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidJob(f"error must be a string, got {type(value).__name__}")
    return value[: limits.ERROR_TEXT_BYTES_MAX]
