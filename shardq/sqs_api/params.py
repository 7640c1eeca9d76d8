"""Reading a request's parameters (the JSON protocol's shapes; the query protocol is turned
into them first, :mod:`.protocol`): typed, with AWS's errors. Query values arrive as text,
so an integer may be given as ``5`` or ``"5"``."""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from .faults import fault, invalid, missing

_INT = re.compile(r"-?[0-9]{1,12}\Z")


@functools.lru_cache(maxsize=8)
def _entry_id(max_chars: int) -> Callable[[str], re.Match[str] | None]:
    """A batch entry Id's check, compiled once per length (it runs for every entry)."""
    return re.compile(rf"[A-Za-z0-9_-]{{1,{max_chars}}}").fullmatch


def string(params: dict[str, Any], name: str, *, required: bool = False) -> str | None:
    value = params.get(name)
    if value is None:
        if required:
            raise missing(name)
        return None
    if not isinstance(value, str):
        raise invalid(f"Value for parameter {name} is invalid. Reason: expected a string.")
    return value


def required(params: dict[str, Any], name: str) -> str:
    """A string parameter the request must carry: MissingParameter without it."""
    value = string(params, name)
    if value is None:
        raise missing(name)
    return value


def integer_or(params: dict[str, Any], name: str, lo: int, hi: int, default: int) -> int:
    """An integer parameter, ``default`` when absent."""
    value = integer(params, name, lo, hi)
    return default if value is None else value


def integer(params: dict[str, Any], name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, str) and _INT.match(value)):
        raise invalid(f"Value {str(value)[:40]} for parameter {name} is invalid. Reason: must be an integer.")
    n = int(value)
    if not lo <= n <= hi:
        raise invalid(f"Value {n} for parameter {name} is invalid. Reason: must be between {lo} and {hi}, "
                      f"if provided.")
    return n


def string_list(params: dict[str, Any], name: str) -> list[str]:
    value = params.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(f"Value for parameter {name} is invalid. Reason: expected a list of strings.")
    return value


def string_map(params: dict[str, Any], name: str) -> dict[str, str]:
    value = params.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid(f"Value for parameter {name} is invalid. Reason: expected a map of strings.")
    return value


def entries(params: dict[str, Any], max_entries: int, max_id_chars: int) -> list[dict[str, Any]]:
    """A batch's entries: 1 to ``max_entries``, each a map with a distinct, valid Id."""
    value = params.get("Entries")
    if value is None or value == []:
        raise fault("EmptyBatchRequest", "There should be at least one entry in the request.")
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise invalid("Value for parameter Entries is invalid. Reason: expected a list of entries.")
    if len(value) > max_entries:
        raise fault("TooManyEntriesInBatchRequest", f"Maximum number of entries per request are {max_entries}. "
                                                    f"You have sent {len(value)}.")
    seen: set[str] = set()
    valid = _entry_id(max_id_chars)
    for e in value:
        eid = e.get("Id")
        if not isinstance(eid, str) or not valid(eid):
            raise fault("InvalidBatchEntryId", f"A batch entry id can only contain alphanumeric characters, "
                                               f"hyphens and underscores. It can be at most {max_id_chars} "
                                               f"letters long.")
        if eid in seen:
            raise fault("BatchEntryIdsNotDistinct", f"Id {eid} repeated.")
        seen.add(eid)
    return value
