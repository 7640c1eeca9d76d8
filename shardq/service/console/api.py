"""What the console's JavaScript calls: a thin JSON layer over the router's calls.

Reads (``overview``, ``dead_letters``, ``job``) never fail because one shard is down: the
overview marks it down, dead-letter pages skip it (and say so). Actions (pause, resume,
cancel, redrive, purge, limits) go through the same router calls as the CLI and raise their
typed errors, which the server turns into JSON error replies.

Job ids travel as strings: they can exceed JavaScript's exact integers (2**53). An action
takes a JSON object of the fields openapi.py documents for it and no other: a typo
(``"queues"``) is refused, not read as a request that names nothing.
"""
from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from ... import limits
from ...client.queue_names import check_exists
from ...client.results import look_up
from ...client.routing import job_id_from_text, job_shard, queue_totals
from ...config import check_limit
from ...errors import InvalidConfig, InvalidJob
from ...protocol import validate
from ...shard.control import COUNTERS
from ...shard.limiter import RUNTIME_KEYS
from ...tasks import body as taskbody
from ...tasks import workflow as workflows
from ...types import JobId

if TYPE_CHECKING:
    from ...client.router import Router
    from ..supervisor import Supervisor

COUNT_KEYS = ("ready", "delayed", "waiting", "in_flight", "dead", "keys")
BODY_PREVIEW_BYTES = 200
PAGE_MAX = 200
# The text forms the API takes, matched whole (openapi.py documents them): int() alone would
# also take " 5", "+5", "5_0" and digits of other scripts.
CURSOR_PATTERN = r"^([0-9]{1,4}:[0-9]{0,19})?$"  # "<shard>:<last id>" as the router makes it, or ""
LIMIT_PATTERN = r"^-?[0-9]{1,9}$"


def _id(value: object) -> int:
    """A job id from JSON (a string of ASCII digits or an integer), checked as the router
    checks it (client/routing.py): InvalidJob, a 400, for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        validate.integer("job_id", value)
        return value
    return job_id_from_text(value)


def _ids(values: object) -> list[JobId]:
    if not isinstance(values, list) or not 0 < len(values) <= limits.BATCH_JOBS_MAX:
        raise InvalidJob(f"ids must be a list of 1 to {limits.BATCH_JOBS_MAX} job ids")
    return [_id(v) for v in values]  # the local shards' ids: ints


def _workflow_id(value: object) -> str:
    """A workflow id from the query, checked as the router checks a record's id
    (client/results.py), with a message that names a workflow: InvalidJob, a 400."""
    if type(value) is not str or not value \
            or len(value.encode("utf-8", "surrogatepass")) > limits.BARRIER_ID_BYTES_MAX:
        raise InvalidJob(f"a workflow id is a string of 1 to {limits.BARRIER_ID_BYTES_MAX} bytes (UTF-8), "
                         f"got {value!r:.60}")
    return value


def _queue(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidJob("queue must be a non-empty string")
    return value


def _fields(data: dict[str, Any], *names: str) -> dict[str, Any]:
    """``data``, refused (InvalidJob) when it holds a field the action does not take: a
    typo (``"queues"``) must not pass for a request that names nothing."""
    extra = sorted(set(data) - set(names))
    if extra:
        raise InvalidJob(f"unknown field {extra[0]!r:.60}; this action takes {', '.join(names)}")
    return data


def _limit_values(values: object) -> dict[str, Any] | None:
    """The ``values`` of a limits change, checked before any shard sees them, as the config
    checks them (InvalidConfig naming the key): None (back to the config's), or a map of
    some of :data:`RUNTIME_KEYS` to a value or None (that limit removed). The shards check
    again, against the queue's config; this keeps what JSON can hold but the wire cannot (an
    integer past 64 bits, a nested list) from reaching them."""
    if values is None:
        return None
    if not isinstance(values, dict) or not values:
        raise InvalidConfig(f"values: expected null or a map of some of {', '.join(RUNTIME_KEYS)}, "
                            f"got {values!r:.60}")
    for key, value in values.items():
        if key not in RUNTIME_KEYS:
            raise InvalidConfig(f"values.{key:.60}: not a limit that changes at run time "
                                f"(one of {', '.join(RUNTIME_KEYS)})")
        if value is not None:
            check_limit(key, key, value)
    return values


def _preview(body: bytes) -> str:
    text = body[:BODY_PREVIEW_BYTES].decode("utf-8", "replace")
    return text + ("…" if len(body) > BODY_PREVIEW_BYTES else "")


def _short(text: str) -> str:
    """``text`` cut to BODY_PREVIEW_BYTES characters (a task name or a barrier id comes
    from whoever enqueued the job, of any length)."""
    return text[:BODY_PREVIEW_BYTES] + ("…" if len(text) > BODY_PREVIEW_BYTES else "")


def _text(value: Any) -> str:
    return _short(value if type(value) is str else repr(value))


def _count(value: Any) -> int | None:
    """An integer of a body's workflow fields, None when the body holds something else: a
    body is written by whoever enqueued it, and only its shape is checked on the way in."""
    return value if type(value) is int else None


def _task(body: bytes) -> dict[str, Any] | None:
    """A task body as the console shows it (``tasks.body.describe``): its name, its
    arguments as JSON text cut like a body preview, and its workflow fields (``keep_result``
    seconds; ``reports_to`` and ``inputs_from``: the barriers it completes and reads its
    input from), null where the body has none. None if ``body`` is not a task body.

    Every value is made a JSON value the document promises (the body's own types are not
    checked inside its workflow fields, and a non-finite number is no JSON)."""
    try:
        task = taskbody.describe(body)
        if task is None:
            return None
        args = json.dumps({"args": task["args"], "kwargs": task["kwargs"]}, ensure_ascii=False, default=repr)
    except RecursionError:  # arguments nested deeper than describe() recurses: shown undecoded
        return None
    keep = task.get("keep_result")
    report, inputs = task.get("reports_to"), task.get("inputs_from")
    return {"name": _short(task["name"]),
            "args": _short(args),
            "keep_result": float(keep) if keep is not None and math.isfinite(keep) else None,
            "reports_to": None if report is None else {
                "barrier": _text(report["barrier"]), "shard": _count(report["shard"]),
                "index": _count(report["index"]), "total": _count(report["total"])},
            "inputs_from": None if inputs is None else {
                "barrier": _text(inputs["barrier"]), "shard": _count(inputs["shard"])}}


class ConsoleApi:
    def __init__(self, router: Router, supervisor: Supervisor | None = None, timeout_s: float = 2.0):
        self.router = router
        self.supervisor = supervisor
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ reads
    def overview(self) -> dict[str, Any]:
        """Queues (summed over the shards that answered), shards (each with its own
        ``totals``, for the charts: docs/operations.md), and totals."""
        shards = self.router.shard_metrics(self.timeout_s)
        queues: dict[str, dict[str, Any]] = {}
        per_shard: dict[int, dict[str, int]] = {}
        for sh in shards:
            own = per_shard[sh["shard"]] = dict.fromkeys(COUNT_KEYS + COUNTERS, 0)
            for name, fig in sh.get("queue_metrics", {}).items():
                counts = sh["queues"].get(name, {})
                q = queues.setdefault(name, dict.fromkeys(COUNT_KEYS + COUNTERS, 0) |
                                      {"name": name, "paused_shards": 0, "oldest_ready_age_s": None})
                for k in COUNT_KEYS:
                    q[k] += counts.get(k, 0)
                    own[k] += counts.get(k, 0)
                for k in COUNTERS:
                    q[k] += fig[k]
                    own[k] += fig[k]
                q["paused_shards"] += bool(fig["paused"])
                age = fig["oldest_ready_age_s"]
                if age is not None and (q["oldest_ready_age_s"] is None or age > q["oldest_ready_age_s"]):
                    q["oldest_ready_age_s"] = age
        # A limited queue's figures are its owner shard's, chosen as ``stats`` chooses them
        # (client/routing.py queue_totals, docs/limits.md); null for a queue without limits.
        counted = queue_totals(shards)
        for name in counted.keys() - queues.keys():  # a limited queue whose owner is down, held by no other
            queues[name] = dict.fromkeys(COUNT_KEYS + COUNTERS, 0) | {"name": name, "paused_shards": 0,
                                                                       "oldest_ready_age_s": None}
        for q in queues.values():
            q["paused"] = q["paused_shards"] > 0
            # paused, but not known to be on every shard: a pause that missed a shard down
            # (or one down now, whose state is not known); pausing again finishes it
            q["partly_paused"] = 0 < q["paused_shards"] < len(shards)
            q["limits"] = counted.get(q["name"], {}).get("limits")
        return {"queues": sorted(queues.values(), key=lambda q: q["name"]),
                "shards": [self._shard_row(sh, per_shard[sh["shard"]] if sh.get("available") else None)
                           for sh in shards],
                "totals": {k: sum(q[k] for q in queues.values()) for k in COUNT_KEYS + COUNTERS}}

    def _shard_row(self, sh: dict[str, Any], totals: dict[str, int] | None) -> dict[str, Any]:
        row = {"shard": sh["shard"], "up": bool(sh.get("available")), "error": sh.get("error"), "totals": totals}
        for k in ("pid", "jobs", "wal_bytes", "segments", "clients", "compactions", "replay_records",
                  "replay_seconds"):
            row[k] = sh.get(k)
        handles = self.supervisor.handles if self.supervisor is not None else []
        if sh["shard"] < len(handles):
            h = handles[sh["shard"]]
            row.update(status=h.status, restarts=h.restarts, last_exit=h.last_exit, reason=h.reason)
            if row["pid"] is None and h.proc is not None and h.status in ("starting", "ready"):
                row["pid"] = h.proc.pid
            if row["replay_records"] is None and h.ready_info:
                row["replay_records"] = h.ready_info.get("records")
                row["replay_seconds"] = h.ready_info.get("replay_s")
        return row

    def dead_letters(self, queue: object, limit: int | str = 50, cursor: str | None = None) -> dict[str, Any]:
        """One page; ``limit`` is clamped to 1..PAGE_MAX; ``cursor`` None or "" for the first.
        Each letter's body as the job look-up shows it: a preview, and ``task`` (a task
        body's name and arguments, :func:`_task`; null for any other body)."""
        if isinstance(limit, str) and re.fullmatch(LIMIT_PATTERN, limit):
            limit = int(limit)
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise InvalidJob(f"limit must be an integer, got {limit!r:.20}")
        if cursor and not (isinstance(cursor, str) and re.fullmatch(CURSOR_PATTERN, cursor)):
            raise InvalidJob(f"not a dead-letter cursor: {cursor!r:.40}")
        page = self.router.dead_letters_page(_queue(queue), min(max(limit, 1), PAGE_MAX), cursor or None,
                                             skip_unavailable=True)
        # A task body decoded as the job panel decodes it (``task``, null for any other
        # body), so a dead task reads as its name and arguments, not as msgpack bytes.
        return {"items": [{"id": str(d.job_id), "key": d.key, "attempts": d.attempts, "error": d.error,
                           "body": _preview(d.body), "body_bytes": len(d.body), "task": _task(d.body)}
                          for d in page.items],
                "cursor": page.cursor, "skipped_shards": page.skipped_shards}

    def job(self, job_id: object) -> dict[str, Any]:
        """What ``shardq job show`` shows of a job (cli/job_control.py): the live job, its
        body previewed and a task body's workflow fields (``task``), its progress and its
        kept result's size and expiry; a job acked whose result is still kept is
        ``"state": "succeeded"`` with those figures only. NotFound (404) if the job is
        neither live nor has a result kept."""
        jid = _id(job_id)
        shard = job_shard(jid, self.router.shards)  # NotFound for a shard this service lacks
        info, outcome = look_up(self.router.job, self.router.results, jid)
        if info is None:
            info = {"job_id": jid, "shard": shard, "state": "succeeded"}
        else:
            body = info.pop("body")
            info.update(body=_preview(body), body_bytes=len(body), task=_task(body))
        info.update(job_id=str(jid), progress=None, note=None, result_bytes=None, result_expires_at=None)
        if outcome is not None:
            info.update(progress=outcome.fraction, note=outcome.note)
            if outcome.state == "succeeded":
                info.update(result_bytes=len(outcome.value or b""), result_expires_at=outcome.expires_at)
        return info

    def workflow(self, wf_id: object) -> dict[str, Any]:
        """What ``shardq workflow show`` shows of a workflow (``tasks.workflow.describe``):
        its record's state, error and times, every step counted by state, and the first
        ``DESCRIBE_STEPS_MAX`` steps (``steps_shown`` of ``steps_total``), each with its job
        id as a string, and its path and task name made text cut as a job look-up cuts a
        task's name (a record is written by whoever sent the workflow). NotFound (404) if
        no record of it is kept; InvalidJob (400) for an id no record can have, or a
        record this version cannot read."""
        # The module's figure, read at each call (describe's default was bound at import).
        info = workflows.describe(self.router, _workflow_id(wf_id), workflows.DESCRIBE_STEPS_MAX)
        for row in info["steps"]:
            row.update(step=_text(row["step"]), task=_text(row["task"]),
                       job_id=None if row["job_id"] is None else str(row["job_id"]))
        return info

    # ------------------------------------------------------------------ actions
    # Each takes the JSON object of the request (the fields openapi.py documents, no other).
    def pause(self, data: dict[str, Any]) -> dict[str, Any]:
        queue = self._known(_queue(_fields(data, "queue").get("queue")))
        return {"queue": queue, "changed_shards": self.router.pause(queue)}

    def resume(self, data: dict[str, Any]) -> dict[str, Any]:
        queue = self._known(_queue(_fields(data, "queue").get("queue")))
        return {"queue": queue, "changed_shards": self.router.resume(queue)}

    def _known(self, queue: str) -> str:
        """``queue`` if it exists; UnknownQueue (a 400 naming those that do) for a name the
        service neither holds nor declares, which an action would otherwise make a queue
        of for good (as ``shardq queue`` refuses it; client/queue_names.py)."""
        check_exists(self.router, queue, create_hint="declare it as [queues.NAME] in the config")
        return queue

    def cancel(self, data: dict[str, Any]) -> dict[str, Any]:
        job_id = _id(_fields(data, "id").get("id"))
        return {"id": str(job_id), "result": self.router.cancel(job_id)}

    def redrive(self, data: dict[str, Any]) -> dict[str, Any]:
        _fields(data, "queue", "ids")
        return {"redriven": self.router.redrive(_queue(data.get("queue")), _ids(data.get("ids")))}

    def purge(self, data: dict[str, Any]) -> dict[str, Any]:
        _fields(data, "queue", "ids")
        return {"purged": self.router.purge_dead_letters(_queue(data.get("queue")), _ids(data.get("ids")))}

    def limits(self, data: dict[str, Any]) -> dict[str, Any]:
        """Change a limited queue's limits at run time (``Router.set_limits``, as ``shardq
        queue limit``): ``values`` null goes back to the config's. Returns the owner
        shard's figures afterwards."""
        _fields(data, "queue", "values")
        if "values" not in data:  # a missing field must not read as "back to the config"
            raise InvalidJob("values is required: a map of the limits to change, or null for the config's")
        queue = _queue(data.get("queue"))
        values = _limit_values(data["values"])
        return {"queue": self._known(queue), "limits": self.router.set_limits(queue, values)}

    ACTIONS = ("pause", "resume", "cancel", "redrive", "purge", "limits")
