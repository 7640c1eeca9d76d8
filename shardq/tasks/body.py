"""The body of a task job: msgpack of ``{"t": name, "a": args, "k": kwargs, "v": 1}``.

Versioned (``v``) so a later format can be told apart; documented in docs/design.md.
msgpack only, never pickle: a body is data any worker (or any language) can read, and
decoding it can run no code. Arguments msgpack cannot encode (a ``datetime``, a ``set``,
an object) are refused at ``.send()`` with :class:`~shardq.errors.InvalidJob` naming the
argument. Tuples arrive as lists, as with JSON.
"""
from __future__ import annotations

import base64
import inspect
from typing import Any

import msgpack

from ..errors import InvalidJob

VERSION = 1
_packb = msgpack.Packer(use_bin_type=True, datetime=False).pack


class BadBody(Exception):
    """A job body is not a task body this worker can run (internal: the worker buries
    the job with this message)."""


def encode(name: str, args: tuple | list, kwargs: dict, signature: inspect.Signature | None = None) -> bytes:
    """The body for a call of task ``name``. InvalidJob names the argument msgpack refused
    (by parameter name when ``signature`` is given)."""
    try:
        return _packb({"t": name, "a": list(args), "k": kwargs, "v": VERSION})
    except (TypeError, ValueError, OverflowError):
        pass
    for where, value in _labelled(args, kwargs, signature):
        try:
            _packb(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidJob(f"task {name}: argument {where} cannot be sent: {_why(value, exc)}; "
                             "task arguments must be msgpack types (None, bool, int, float, str, "
                             "bytes, list, tuple, dict)") from None
    raise InvalidJob(f"task {name}: the arguments cannot be encoded")  # not reached in practice


def decode(body: bytes) -> tuple[str, list, dict]:
    """``(name, args, kwargs)`` of a task body; BadBody says why it is not one."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input; all mean BadBody
        raise BadBody(f"the job body is not msgpack ({type(exc).__name__}): not a task job") from None
    if type(obj) is not dict or "t" not in obj:
        raise BadBody("the job body is not a task body (no task name 't'): not a task job")
    version = obj.get("v")
    if version != VERSION:
        raise BadBody(f"task body version {version!r}: this worker reads version {VERSION}")
    name, args, kwargs = obj.get("t"), obj.get("a", []), obj.get("k", {})
    if type(name) is not str or type(args) is not list or type(kwargs) is not dict \
            or not all(type(k) is str for k in kwargs):
        raise BadBody("malformed task body: 't' must be a string, 'a' an array, 'k' a map of strings")
    return name, args, kwargs


def describe(body: bytes) -> dict | None:
    """A task body as plain JSON values, for people and tools that show jobs (the CLI, the
    console): ``{"name": ..., "args": [...], "kwargs": {...}}``; None if ``body`` is not a
    task body of this version. Bytes inside the arguments become ``{"base64": "..."}``;
    it runs no code and changes nothing."""
    try:
        name, args, kwargs = decode(body)
    except BadBody:
        return None
    return {"name": name, "args": _plain(args), "kwargs": _plain(kwargs)}


def _plain(value: Any) -> Any:
    """``value`` with what JSON cannot hold (bytes, msgpack's own types) made JSON values."""
    if isinstance(value, (bytes, bytearray)):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # a msgpack extension type: shown, not interpreted


def _labelled(args, kwargs, signature):
    names = []
    if signature is not None:
        params = list(signature.parameters.values())[1:]  # after ctx
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        label = f"{names[i]!r} (position {i})" if i < len(names) else f"at position {i}"
        yield label, value
    for k, value in kwargs.items():
        yield repr(k), value


def _why(value: Any, exc: BaseException) -> str:
    if isinstance(exc, OverflowError):
        return "integer out of msgpack's 64-bit range"
    return f"{type(value).__name__} is not a msgpack type"
