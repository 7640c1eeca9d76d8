"""The body of a task job: msgpack of ``{"t": name, "a": args, "k": kwargs, "v": 1}``.

Versioned (``v``) so a later format can be told apart; documented in docs/design.md.
Version 2 adds what results and workflows need (docs/design.md, "Workflows and results"):
``"r"`` (seconds to keep the result), ``"w"`` (where to report it: ``[barrier id, shard,
index, total, ttl_s, callback item]``) and ``"in"`` (``[barrier id, shard, "one" | "all"]``:
where the inputs are). A body without them stays version 1, so workers of the version
before read every plain task job, and refuse, with the reason, a job they would run
without finishing its workflow.
msgpack only, never pickle: a body is data any worker (or any language) can read, and
decoding it can run no code. Arguments msgpack cannot encode (a ``datetime``, a ``set``,
an object) are refused at ``.send()`` with :class:`~shardq.errors.InvalidJob` naming the
argument. Tuples arrive as lists, as with JSON.
"""
from __future__ import annotations

import base64
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgpack

from ..errors import InvalidJob

VERSION = 1
VERSION_WORKFLOW = 2
VERSIONS = (VERSION, VERSION_WORKFLOW)
_packb = msgpack.Packer(use_bin_type=True, datetime=False).pack


class BadBody(Exception):
    """A job body is not a task body this worker can run (internal: the worker buries
    the job with this message)."""


class Steps(NamedTuple):
    """The version-2 fields of a task body (all None in a version-1 body)."""
    keep_s: float | None          # "r": seconds to keep the result
    report: list[Any] | None      # "w": [barrier id, shard, index, total, ttl_s, callback item]
    inputs: list[Any] | None      # "in": [barrier id, shard, "one" | "all"]


NO_STEPS = Steps(None, None, None)


def encode(name: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
           signature: inspect.Signature | None = None,
           steps: Steps = NO_STEPS) -> bytes:
    """The body for a call of task ``name``. InvalidJob names the argument msgpack refused
    (by parameter name when ``signature`` is given)."""
    obj: dict[str, Any] = {"t": name, "a": list(args), "k": kwargs, "v": VERSION}
    if steps != NO_STEPS:
        obj["v"] = VERSION_WORKFLOW
        for field, value in zip(("r", "w", "in"), steps):
            if value is not None:
                obj[field] = value
    try:
        packed: bytes = _packb(obj)
        return packed
    except (TypeError, ValueError, OverflowError):
        pass
    for where, value in _labelled(args, kwargs, signature):
        try:
            _packb(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidJob(f"task {name}: argument {where} cannot be sent: {why(value, exc)}") from None
    raise InvalidJob(f"task {name}: the arguments cannot be encoded")  # not reached in practice


def decode(body: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    """``(name, args, kwargs)`` of a task body; BadBody says why it is not one."""
    name, args, kwargs, _ = decode_steps(body)
    return name, args, kwargs


def decode_steps(body: bytes) -> tuple[str, list[Any], dict[str, Any], Steps]:
    """As :func:`decode`, and the body's version-2 fields."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input; all mean BadBody
        raise BadBody(f"the job body is not msgpack ({type(exc).__name__}): not a task job") from None
    if type(obj) is not dict or "t" not in obj:
        raise BadBody("the job body is not a task body (no task name 't'): not a task job")
    version = obj.get("v")
    if version not in VERSIONS:
        raise BadBody(f"task body version {version!r}: this worker reads versions {VERSION} and {VERSION_WORKFLOW}")
    name, args, kwargs = obj.get("t"), obj.get("a", []), obj.get("k", {})
    if type(name) is not str or type(args) is not list or type(kwargs) is not dict \
            or not all(type(k) is str for k in kwargs):
        raise BadBody("malformed task body: 't' must be a string, 'a' an array, 'k' a map of strings")
    if version == VERSION:
        return name, args, kwargs, NO_STEPS
    steps = Steps(obj.get("r"), obj.get("w"), obj.get("in"))
    if not (steps.keep_s is None or (isinstance(steps.keep_s, (int, float)) and not isinstance(steps.keep_s, bool)
                                     and steps.keep_s > 0)) \
            or not (steps.report is None or (type(steps.report) is list and len(steps.report) == 6)) \
            or not (steps.inputs is None or (type(steps.inputs) is list and len(steps.inputs) == 3
                                             and steps.inputs[2] in ("one", "all"))):
        raise BadBody("malformed task body: 'r' must be seconds, 'w' [barrier, shard, index, total, ttl, "
                      "callback], 'in' [barrier, shard, 'one' | 'all']")
    return name, args, kwargs, steps


def describe(body: bytes) -> dict[str, Any] | None:
    """A task body as plain JSON values, for people and tools that show jobs (the CLI, the
    console): ``{"name": ..., "args": [...], "kwargs": {...}}``, plus for a job of a
    workflow or one whose result is kept ``keep_result`` (seconds), ``reports_to``
    (``{"barrier", "shard", "index", "total"}``: the step or chord it completes) and
    ``inputs_from`` (``{"barrier", "shard"}``) and ``workflow`` (the workflow's id, which
    names its barriers); None if ``body`` is not a task body this
    version reads. Bytes inside the arguments become ``{"base64": "..."}``; it runs no
    code and changes nothing."""
    try:
        name, args, kwargs, steps = decode_steps(body)
    except BadBody:
        return None
    try:
        out: dict[str, Any] = {"name": name, "args": _plain(args), "kwargs": _plain(kwargs)}
        if steps.keep_s is not None:
            out["keep_result"] = steps.keep_s
        if steps.report is not None:
            barrier, shard, index, total = steps.report[:4]
            out["reports_to"] = _plain({"barrier": barrier, "shard": shard, "index": index, "total": total})
        if steps.inputs is not None:
            out["inputs_from"] = _plain({"barrier": steps.inputs[0], "shard": steps.inputs[1]})
        barrier = (steps.report or steps.inputs or [None])[0]
        if type(barrier) is str and "." in barrier:  # "<workflow id>.<n>": shardq workflow show takes the id
            out["workflow"] = barrier.split(".", 1)[0]
    except RecursionError:  # arguments nested deeper than Python recurses: shown as bytes instead
        return None
    return out


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


def _labelled(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
              signature: inspect.Signature | None) -> Iterator[tuple[str, Any]]:
    names: list[str] = []
    if signature is not None:
        params = list(signature.parameters.values())[1:]  # after ctx
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        label = f"{names[i]!r} (position {i})" if i < len(names) else f"at position {i}"
        yield label, value
    for k, value in kwargs.items():
        yield repr(k), value


#: How deep :func:`why` looks into lists and dicts for the value msgpack refused.
WHY_DEPTH_MAX = 100
_TYPES = "msgpack types (None, bool, int, float, str, bytes, list, tuple, dict)"


def why(value: Any, exc: BaseException) -> str:
    """Why msgpack refused ``value`` (``exc``), in a sentence: the value inside it that it
    refused (``at [2]['name']``), and for what: a type msgpack has not, an int past 64 bits,
    or a str holding what UTF-8 cannot encode (a lone surrogate: a file name decoded by
    ``os.fsdecode``, say)."""
    where, bad, err = _culprit(value, exc)
    at = f" (at {where})" if where else ""
    if isinstance(err, UnicodeEncodeError) and isinstance(bad, str):
        char = err.object[err.start:err.start + 1] if isinstance(err.object, str) else ""
        return (f"the str{at} is not valid UTF-8 text: it holds {char!r} at index {err.start}, a lone surrogate, "
                "which UTF-8 cannot encode (a name decoded with os.fsdecode, say: send it as bytes, "
                "os.fsencode(name), or as text that is)")
    if isinstance(err, OverflowError):
        return f"integer{at} out of msgpack's 64-bit range; values must be {_TYPES}"
    if _too_deep(err):
        return f"it is nested deeper than msgpack encodes ({err})"
    return f"{type(bad).__name__}{at} is not a msgpack type; values must be {_TYPES}"


def _culprit(value: Any, exc: BaseException) -> tuple[str, Any, BaseException]:
    """The path inside ``value`` to the first value msgpack refuses alone (``""``: itself),
    that value, and msgpack's error for it: a list or dict is looked into, a map's keys
    before its values."""
    where = ""
    for _ in range(WHY_DEPTH_MAX if not _too_deep(exc) else 0):
        if isinstance(value, (list, tuple)):
            parts: list[tuple[str, Any]] = [(f"[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            parts = []
            for k, v in value.items():
                parts += [(f" key {k!r:.40}", k), (f"[{k!r:.40}]", v)]
        else:
            break
        for label, inner in parts:
            try:
                _packb(inner)
            except (TypeError, ValueError, OverflowError) as inner_exc:
                where, value, exc = where + label, inner, inner_exc
                break
        else:
            break  # each part alone packs (too deep as a whole, say): the value itself is named
        if label.startswith(" key"):
            break  # a key: named as it is
    return where.strip(), value, exc


def _too_deep(exc: BaseException) -> bool:
    return type(exc) is ValueError and "recursion" in str(exc)
