"""The HTTP API of ``shardq serve`` described as OpenAPI 3.1: every route the listener
answers, its parameters, JSON bodies, replies and errors.

The listener (:mod:`..http_server`) serves :func:`document` at ``GET /openapi.json``. Its
dispatch tables and this document name the same routes (``tests/service/test_console_fuzz.py``
holds them equal, so neither can gain a route the other lacks), and that test fuzzes a real
listener from this document.

``/openapi.json`` is public, as the login page and the static assets are: it is the same
document for every install (built from the package, like those assets), it holds no data
and changes nothing, and a client needs it to learn how to authenticate before it has
a token. The ``Host`` check of an open (``auth = "none"``) listener still applies to it.

What the document promises, and the server keeps:

* every reply of ``/api/`` is JSON; an error is ``{"error": <the shardq error class, or the
  HTTP status phrase>, "message": <text>}`` with 400 (bad input: ``InvalidJob``; a bad limit
  value, named, or a queue without limits: ``InvalidConfig``), 401 (no
  token), 403 (CSRF, ``Origin`` or ``Host``), 404 (no such job or page), 405 (another
  method; ``Allow`` names the route's), 411 (a transfer coding other than chunked alone),
  413 (a body over ``limits.HTTP_BODY_BYTES_MAX``, with a Content-Length or chunked),
  415 (a POST that is not JSON) or 503 (a shard is down or full: ``ShardUnavailable``,
  ``QueueFull``); a 5xx other than 503 is a bug;
* a JSON body with a field the operation does not take is refused (400), so a typo is not
  ignored; numbers in the query are ASCII digits (``int()`` alone would take " 5", "+5");
* job ids travel as strings of ASCII digits (they can exceed JavaScript's exact integers);
  an integer is taken too;
* a string the server limits in bytes of UTF-8 (a queue name, a workflow id, a progress
  note) has that limit as ``maxLength``, which counts characters: the most characters it
  can have. Its description gives the limit in bytes (JSON Schema cannot), by which a
  shorter string of non-ASCII characters may still be refused (400).
"""
from __future__ import annotations

import copy
from typing import Any

from ... import limits
from ...shard.control import COUNTERS
from ...tasks.workflow import DESCRIBE_STEPS_MAX
from .api import BODY_PREVIEW_BYTES, COUNT_KEYS, CURSOR_PATTERN, PAGE_MAX

OPENAPI_VERSION = "3.1.0"
API_VERSION = "1"

# Who may call: the token as a bearer header (scripts, Prometheus), or the session cookie
# that logging in sets (people); a POST with the cookie needs the CSRF header too.
_Security = list[dict[str, list[str]]]
_TOKEN: _Security = [{"bearer": []}, {"session": []}]
_ACTION: _Security = [{"bearer": []}, {"session": [], "csrf": []}]
_PUBLIC: _Security = []


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _nullable(kind: str) -> dict[str, Any]:
    return {"type": [kind, "null"]}


_INT0 = {"type": "integer", "minimum": 0}


def _utf8(most: int, what: str, *, nullable: bool = False, sent: bool = True, min_length: int = 1
          ) -> dict[str, Any]:
    """A string the server limits to ``most`` bytes of UTF-8 (``sent``: one a request sends,
    which the server refuses past its limit; else one a reply holds). JSON Schema's
    ``maxLength`` counts characters and cannot state a byte length: ``most`` characters is
    the most any such string has (each takes at least one byte), and the description states
    the limit in bytes."""
    more = (f"; a character outside ASCII takes 2 to 4 bytes, so a string of {most} characters or fewer may "
            f"still be over it, and is refused (400)" if sent else "")
    schema: dict[str, Any] = {"type": ["string", "null"] if nullable else "string"}
    if min_length:
        schema["minLength"] = min_length
    schema.update(maxLength=most, description=f"{what}: at most {most} bytes of UTF-8 (maxLength counts "
                                              f"characters: JSON Schema cannot state a length in bytes){more}")
    return schema


_JOB_ID_TEXT = {"type": "string", "pattern": "^[0-9]{1,19}$",
                "description": "a job id: ASCII digits, below 2**63"}
_JOB_ID = {"oneOf": [_JOB_ID_TEXT, {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}]}
_QUEUE = _utf8(limits.QUEUE_NAME_BYTES_MAX, "a queue name")
_NUMBER0 = {"type": "number", "minimum": 0}
_CAP = {"type": ["integer", "null"], "minimum": 1, "maximum": limits.CONCURRENCY_MAX}
_RATE = {"type": ["string", "null"], "maxLength": 64,
         "description": "leases started per second, minute or hour: \"50/s\", \"100/m\", \"5/h\""}

# What a job look-up says of a job's outcome, live or not (docs/workflows.md).
_OUTCOME = {
    "progress": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                 "description": "the fraction its task last reported (ctx.progress), while it is live"},
    "note": _utf8(limits.PROGRESS_NOTE_BYTES_MAX, "the note its task last reported, while it is live",
                  nullable=True, sent=False, min_length=0),
    "result_bytes": {"type": ["integer", "null"], "minimum": 0, "maximum": limits.RESULT_BYTES_MAX,
                     "description": "the size of its kept result (msgpack); null: none kept"},
    "result_expires_at": {"type": ["number", "null"], "description": "when its kept result expires"},
}

# A workflow's step (tasks/reading.py status_rows): "pending" until a barrier enqueues its
# job, then its job's state; "succeeded" also for a step whose value went to a barrier that
# counted it; "cancelled" (its barrier was), "gone" (cancelled, purged or expired).
_STEP_STATES = ["pending", "waiting", "delayed", "ready", "leased", "succeeded", "dead", "cancelled", "gone"]
_WORKFLOW_STATES = ["running", "succeeded", "failed", "cancelled"]
_WORKFLOW_ID = _utf8(limits.BARRIER_ID_BYTES_MAX, "a workflow id")

_SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {"type": "object", "required": ["error", "message"],
              "properties": {"error": {"type": "string",
                                       "description": "the shardq error class, or the HTTP status phrase"},
                             "message": {"type": "string"}}},
    "Session": {"type": "object", "required": ["csrf", "auth", "data_dir"],
                "properties": {"csrf": {"type": "string", "description": "the X-CSRF-Token value"},
                               "auth": {"enum": ["open", "token"]},
                               "data_dir": {"type": "string"}}},
    "Queue": {"type": "object",
              "required": ["name", "paused", "partly_paused", "paused_shards", "oldest_ready_age_s",
                           "limits", *COUNT_KEYS, *COUNTERS],
              "properties": {"name": {"type": "string"}, "paused": {"type": "boolean"}, "paused_shards": _INT0,
                             "oldest_ready_age_s": {"type": ["number", "null"], "minimum": 0},
                             "partly_paused": {"type": "boolean",
                                               "description": "paused on some shards but not every one: a "
                                               "pause that missed a shard down, or one down now (its state "
                                               "not known); pausing again finishes it"},
                             "limits": {"oneOf": [{"type": "null"}, _ref("LimitFigures"), _ref("LimitsUnknown")],
                                        "description": "null: the queue declares no limit; else its owner "
                                        "shard's figures, or why there are none"},
                             **{k: _INT0 for k in (*COUNT_KEYS, *COUNTERS)}}},
    # What stats shows of a limited queue, from the shard that holds it (docs/limits.md,
    # "Seeing the limits"); a figure is present only where its limit is set.
    "LimitFigures": {"type": "object", "required": ["in_flight", "max_in_flight_seen", "held_back"],
                     "properties": {
                         "owner": {**_INT0, "description": "the owner shard, whose figures these are "
                                   "(the overview names it)"},
                         "in_flight": _INT0, "max_in_flight_seen": _INT0, "held_back": _INT0,
                         "concurrency": _INT0, "rate_per_s": _NUMBER0, "burst": _NUMBER0, "tokens": _NUMBER0,
                         "group_separator": {"type": "string"}, "fair": {"type": "boolean"}, "groups": _INT0,
                         "groups_held_back": _INT0, "max_group_in_flight_seen": _INT0,
                         "group_concurrency": _INT0, "group_rate_per_s": _NUMBER0, "group_burst": _NUMBER0,
                         "fenced_until": {"type": "number", "description": "Unix time before which the queue "
                                          "leases nothing, after a power cut (docs/limits.md)"},
                         "runtime_override": {"type": "object",
                                              "description": "the values changed at run time (null: removed)"}}},
    # A limited queue whose owner shard is down, or holds no figures of it yet: no figures
    # (another shard's would be wrong: docs/limits.md).
    "LimitsUnknown": {"type": "object", "required": ["owner", "owner_down"], "additionalProperties": False,
                      "properties": {"owner": _INT0, "owner_down": {"type": "boolean"}}},
    "Shard": {"type": "object", "required": ["shard", "up", "error", "totals"],
              "properties": {"shard": _INT0, "up": {"type": "boolean"}, "error": _nullable("string"),
                             "totals": {"oneOf": [{"type": "null", "description": "down: not known"},
                                                  _ref("Totals")],
                                        "description": "this shard's counts and counters (the charts count "
                                        "each shard's own: docs/operations.md)"},
                             **{k: _nullable("integer") for k in ("pid", "jobs", "wal_bytes", "segments",
                                                                  "clients", "compactions", "replay_records",
                                                                  "restarts")},
                             "replay_seconds": _nullable("number"),
                             "status": {"enum": ["starting", "ready", "restarting", "failed", "stopped"]},
                             "last_exit": _nullable("string"), "reason": _nullable("string")}},
    "Overview": {"type": "object", "required": ["queues", "shards", "totals"],
                 "properties": {"queues": {"type": "array", "items": _ref("Queue")},
                                "shards": {"type": "array", "items": _ref("Shard")},
                                "totals": _ref("Totals")}},
    "Totals": {"type": "object", "required": [*COUNT_KEYS, *COUNTERS],
               "properties": {k: _INT0 for k in (*COUNT_KEYS, *COUNTERS)}},
    "DeadLetter": {"type": "object", "required": ["id", "key", "attempts", "error", "body", "body_bytes", "task"],
                   "properties": {"id": _JOB_ID_TEXT, "key": _nullable("string"), "attempts": _INT0,
                                  "error": _nullable("string"),
                                  "body": {"type": "string", "description": "the first 200 bytes, as text"},
                                  "body_bytes": _INT0,
                                  "task": {"oneOf": [{"type": "null", "description": "not a task body"},
                                                     _ref("Task")]}}},
    "DeadLetterPage": {"type": "object", "required": ["items", "cursor", "skipped_shards"],
                       "properties": {"items": {"type": "array", "items": _ref("DeadLetter")},
                                      "cursor": {"type": ["string", "null"], "pattern": CURSOR_PATTERN,
                                                 "description": "pass it back for the next page; null: no more"},
                                      "skipped_shards": {"type": "array", "items": _INT0}}},
    # A job look-up (what `shardq job show` prints): the live job, or one acked whose result
    # is still kept ("succeeded"); the states of the two are apart, so one schema matches.
    "Job": {"oneOf": [_ref("LiveJob"), _ref("SucceededJob")]},
    "LiveJob": {"type": "object",
                "required": ["job_id", "shard", "queue", "key", "state", "attempts", "priority", "deadline",
                             "error", "position", "cancelled", "queue_paused", "enqueued_at", "body", "body_bytes",
                             "task", *_OUTCOME],
                "properties": {"job_id": _JOB_ID_TEXT, "shard": _INT0, "queue": {"type": "string"},
                               "key": _nullable("string"),
                               "state": {"enum": ["waiting", "delayed", "ready", "leased", "dead"]},
                               "attempts": _INT0, "priority": {"type": "integer"},
                               "deadline": _nullable("number"), "error": _nullable("string"),
                               "position": {"type": ["integer", "null"], "minimum": 0},
                               "cancelled": {"type": "boolean"}, "queue_paused": {"type": "boolean"},
                               "enqueued_at": _nullable("number"),
                               "body": {"type": "string", "description": "the first 200 bytes, as text"},
                               "body_bytes": _INT0,
                               "task": {"oneOf": [{"type": "null", "description": "not a task body"},
                                                  _ref("Task")]},
                               **_OUTCOME}},
    "SucceededJob": {"type": "object", "additionalProperties": False,
                     "description": "acked, its result kept (keep_result, or a workflow's step) until it expires",
                     "required": ["job_id", "shard", "state", *_OUTCOME],
                     "properties": {"job_id": _JOB_ID_TEXT, "shard": _INT0, "state": {"enum": ["succeeded"]},
                                    **_OUTCOME}},
    # A task body (tasks/body.py describe()): a workflow's step names the barrier it
    # completes (reports_to) and the one it reads its input from (inputs_from). The values
    # come from whoever enqueued the job: an integer field holding something else is null.
    "Task": {"type": "object", "required": ["name", "args", "keep_result", "reports_to", "inputs_from"],
             "properties": {
                 "name": {"type": "string", "description": "the task's name (its first 200 characters)"},
                 "args": {"type": "string", "description": "the first 200 characters of the arguments as "
                                                           "JSON: {\"args\": [...], \"kwargs\": {...}}"},
                 "keep_result": {"type": ["number", "null"], "exclusiveMinimum": 0,
                                 "description": "seconds its result is kept after it succeeded"},
                 "reports_to": {"oneOf": [{"type": "null"}, {
                     "type": "object", "required": ["barrier", "shard", "index", "total"],
                     "description": "the barrier this job completes: member index of total",
                     "properties": {"barrier": {"type": "string"}, "shard": _nullable("integer"),
                                    "index": _nullable("integer"), "total": _nullable("integer")}}]},
                 "inputs_from": {"oneOf": [{"type": "null"}, {
                     "type": "object", "required": ["barrier", "shard"],
                     "description": "the barrier whose values are this job's input",
                     "properties": {"barrier": {"type": "string"}, "shard": _nullable("integer")}}]}}},
    # A workflow look-up (what `shardq workflow show` prints: tasks/workflow.py describe()).
    "Workflow": {
        "type": "object", "additionalProperties": False,
        "required": ["id", "state", "error", "started_at", "ended_at", "expires_at", "steps_total",
                     "steps_by_state", "steps", "steps_shown"],
        "properties": {
            "id": _utf8(limits.BARRIER_ID_BYTES_MAX, "the workflow id", sent=False),
            "state": {"enum": _WORKFLOW_STATES,
                      "description": "running, or how it ended as the service's watcher recorded it "
                                     "(within a few seconds of its last step)"},
            "error": {"type": ["string", "null"],
                      "description": "failed: the step that was dead-lettered and its error; cancelled: why"},
            "started_at": {"type": "number", "description": "when it was sent (its record put)"},
            "ended_at": {"type": ["number", "null"], "description": "when its end was recorded; null: running"},
            "expires_at": {"type": ["number", "null"],
                           "description": "when its ended record is dropped; null: running (kept)"},
            "steps_total": _INT0,
            "steps_by_state": {"type": "object", "propertyNames": {"enum": _STEP_STATES},
                               "additionalProperties": {"type": "integer", "minimum": 1},
                               "description": "every step (shown or not) counted by its state"},
            "steps": {"type": "array", "items": _ref("WorkflowStep"),
                      "description": f"the first steps in step order (at most {DESCRIBE_STEPS_MAX})"},
            "steps_shown": {**_INT0, "description": "the length of steps; below steps_total: cut"}}},
    "WorkflowStep": {
        "type": "object", "additionalProperties": False,
        "required": ["step", "task", "job_id", "state", "attempts", "progress", "note", "error", "result_bytes"],
        "properties": {
            "step": {"type": "string",
                     "description": "its path: 0.k the top chain's step k, 0.k.j member j of a group there"},
            "task": {"type": "string",
                     "description": f"its task's name (its first {BODY_PREVIEW_BYTES} characters)"},
            "job_id": {"type": ["string", "null"], "pattern": _JOB_ID_TEXT["pattern"],
                       "description": "its job (ASCII digits); null until a barrier enqueues it"},
            "state": {"enum": _STEP_STATES},
            "attempts": {"type": ["integer", "null"], "minimum": 0,
                         "description": "deliveries of its live job; null once it is not live"},
            "progress": _OUTCOME["progress"], "note": _OUTCOME["note"],
            "error": {"type": ["string", "null"], "description": "its job's last error"},
            "result_bytes": _OUTCOME["result_bytes"],
            "arrived": {"type": ["integer", "null"], "minimum": 0,
                        "description": "a pending step whose barrier has seen an arrival: members arrived"},
            "total": {"type": ["integer", "null"], "minimum": 1, "description": "... of this many"}}},
    "QueueRequest": {"type": "object", "required": ["queue"], "additionalProperties": False,
                     "properties": {"queue": _QUEUE}},
    "QueueChange": {"type": "object", "required": ["queue", "changed_shards"],
                    "properties": {"queue": {"type": "string"}, "changed_shards": _INT0}},
    "CancelRequest": {"type": "object", "required": ["id"], "additionalProperties": False,
                      "properties": {"id": _JOB_ID}},
    "CancelResult": {"type": "object", "required": ["id", "result"],
                     "properties": {"id": _JOB_ID_TEXT,
                                    "result": {"enum": ["cancelled", "purged", "cancelling", "gone"]}}},
    "IdsRequest": {"type": "object", "required": ["queue", "ids"], "additionalProperties": False,
                   "properties": {"queue": _QUEUE,
                                  "ids": {"type": "array", "minItems": 1, "maxItems": limits.BATCH_JOBS_MAX,
                                          "items": _JOB_ID}}},
    "LimitsRequest": {
        "type": "object", "required": ["queue", "values"], "additionalProperties": False,
        "properties": {
            "queue": _QUEUE,
            "values": {"oneOf": [
                {"type": "null", "description": "back to the config's limits"},
                {"type": "object", "minProperties": 1, "additionalProperties": False,
                 "description": "the limits to change (the others keep theirs); null removes that limit",
                 "properties": {"concurrency": _CAP, "group_concurrency": _CAP, "rate": _RATE,
                                "group_rate": _RATE,
                                "burst": {"type": ["number", "null"], "minimum": 1,
                                          "maximum": limits.BURST_MAX}}}]}}},
    "LimitsChange": {"type": "object", "required": ["queue", "limits"],
                     "properties": {"queue": {"type": "string"}, "limits": _ref("LimitFigures")}},
    "Redriven": {"type": "object", "required": ["redriven"], "properties": {"redriven": _INT0}},
    "Purged": {"type": "object", "required": ["purged"], "properties": {"purged": _INT0}},
}

_SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "the token: [http] token, SHARDQ_HTTP_TOKEN, or <data dir>/http-token"},
    "session": {"type": "apiKey", "in": "cookie", "name": "shardq_session",
                "description": "set by logging in (GET /login?token=..., POST /login)"},
    "csrf": {"type": "apiKey", "in": "header", "name": "X-CSRF-Token",
             "description": "the csrf value of GET /api/session; with the session cookie on every POST"},
}

_UNAUTHORIZED = _error("no token: neither the bearer header nor the session cookie")
_DENIED = _error("the Host is not loopback (a listener without a token), or, on a POST with the "
                 "session cookie, the X-CSRF-Token is missing or wrong or the Origin is foreign")
_BAD = _error("bad input (InvalidJob)")
_DOWN = _error("a shard is down, or full (ShardUnavailable, QueueFull)")
_REDIRECT = {"description": "see Location", "headers": {"Location": {"schema": {"type": "string"}}}}
_HTML = {"description": "an HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}


def _read(summary: str, ok: dict[str, Any], params: list[dict[str, Any]] | None = None,
          not_found: str | None = None, bad: str | None = None) -> dict[str, Any]:
    responses = {"200": ok, "400": _error(bad) if bad else _BAD, "401": _UNAUTHORIZED, "403": _DENIED, "503": _DOWN}
    if not_found:
        responses["404"] = _error(not_found)
    return {"summary": summary, "security": _TOKEN, "parameters": params or [], "responses": responses}


_UNKNOWN_QUEUE = ("bad input (InvalidJob), or a queue that does not exist (UnknownQueue, naming those that do): "
                  "one the service neither holds nor declares in its config is not made by naming it")


def _action(summary: str, request: str, reply: str, not_found: str | None = None,
            bad: str | None = None) -> dict[str, Any]:
    responses = {"200": _json(_ref(reply), "done"), "400": _error(bad) if bad else _BAD,
                 "401": _UNAUTHORIZED, "403": _DENIED,
                 "411": _error("a transfer coding other than chunked alone"),
                 "413": _error(f"a body over {limits.HTTP_BODY_BYTES_MAX} bytes"),
                 "415": _error("the body is not application/json"), "503": _DOWN}
    if not_found:
        responses["404"] = _error(not_found)
    return {"summary": summary, "security": _ACTION,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": responses}


def _query(name: str, schema: dict[str, Any], description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


_PATHS: dict[str, dict[str, Any]] = {
    "/": {"get": {"summary": "the console page (a redirect to /login without a session)", "security": _PUBLIC,
                  "responses": {"200": _HTML, "303": _REDIRECT}}},
    "/static/{name}": {"get": {
        "summary": "the console's assets (shipped in the package)", "security": _PUBLIC,
        "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the asset",
                              "content": {t: {"schema": {"type": "string"}}
                                          for t in ("text/html", "text/javascript", "text/css", "image/svg+xml")}},
                      "403": _DENIED, "404": _error("no such asset")}}},
    "/login": {
        "get": {"summary": "the login page; with ?token= logs in (sets the session cookie) and goes to /",
                "security": _PUBLIC,
                "parameters": [_query("token", {"type": "string"}, "the token (the URL `shardq console` prints)")],
                "responses": {"200": _HTML, "303": _REDIRECT, "403": _DENIED}},
        "post": {"summary": "logs in with the token of the form; goes to / (or back to /login?failed=1)",
                 "security": _PUBLIC,
                 "requestBody": {"required": False, "content": {"application/x-www-form-urlencoded": {
                     "schema": {"type": "object", "properties": {"token": {"type": "string"}}}}}},
                 "responses": {"303": _REDIRECT, "403": _DENIED,
                               "413": _error(f"a body over {limits.HTTP_BODY_BYTES_MAX} bytes")}}},
    "/logout": {"post": {"summary": "drops the session cookie; goes to /login", "security": _PUBLIC,
                         "responses": {"303": _REDIRECT, "403": _DENIED,
                                       "413": _error(f"a body over {limits.HTTP_BODY_BYTES_MAX} bytes")}}},
    "/openapi.json": {"get": {"summary": "this document", "security": _PUBLIC,
                              "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1"), "403": _DENIED}}},
    "/metrics": {"get": {
        "summary": "Prometheus text format (docs/operations.md, \"Metrics\")",
        "description": "Open without the token on a loopback listener, asked with a loopback Host, "
                       "unless [http] metrics_public = false.",
        "security": [*_TOKEN, {}],
        "responses": {"200": {"description": "the metrics",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                      "401": _UNAUTHORIZED, "403": _DENIED}}},
    "/api/session": {"get": _read("the CSRF value for POSTs, and how the listener authenticates",
                                  _json(_ref("Session"), "the session"))},
    "/api/overview": {"get": _read("queues (summed over the shards that answered), shards, totals",
                                   _json(_ref("Overview"), "the overview"))},
    "/api/dead-letters": {"get": _read(
        "one page of a queue's dead letters, shard by shard, lowest id first",
        _json(_ref("DeadLetterPage"), "the page"),
        [_query("queue", _QUEUE, "the queue (default: default)"),
         _query("limit", {"type": "integer", "minimum": -(10**9 - 1), "maximum": 10**9 - 1},
                f"letters on the page, clamped to 1..{PAGE_MAX} (default 50)"),
         _query("cursor", {"type": "string", "pattern": CURSOR_PATTERN},
                "the cursor of the previous page (empty or absent: the first page)")])},
    "/api/job": {"get": _read("what the service knows of a job: live, or acked with its result kept",
                              _json(_ref("Job"), "the job"),
                              [_query("id", _JOB_ID_TEXT, "the job id", required=True)],
                              not_found="no live job of that id and no result kept: finished, cancelled, "
                                        "purged or never enqueued")},
    "/api/workflow": {"get": _read("a workflow's record (how it ended, or that it runs) and its steps",
                                   _json(_ref("Workflow"), "the workflow"),
                                   [_query("id", _WORKFLOW_ID, "the workflow id (wf.id)", required=True)],
                                   not_found="no record of that id: never sent with a record, or ended "
                                             "and expired",
                                   bad="an id no record can have, or a record this version cannot read "
                                       "(InvalidJob)")},
    "/api/pause": {"post": _action("stop leasing from a queue, durably, on every shard", "QueueRequest",
                                   "QueueChange", bad=_UNKNOWN_QUEUE)},
    "/api/resume": {"post": _action("lease from a queue again", "QueueRequest", "QueueChange",
                                    bad=_UNKNOWN_QUEUE)},
    "/api/cancel": {"post": _action("cancel a job (idempotent)", "CancelRequest", "CancelResult",
                                    not_found="the id names a shard this service does not have")},
    "/api/redrive": {"post": _action("move chosen dead letters back into their queue", "IdsRequest", "Redriven",
                                     not_found="an id is not a dead letter of the queue")},
    "/api/purge": {"post": _action("delete chosen dead letters (ids that are not are skipped)", "IdsRequest",
                                   "Purged")},
    "/api/limits": {"post": _action(
        "change a limited queue's limits at run time, durably, on every shard (docs/limits.md)",
        "LimitsRequest", "LimitsChange",
        bad="bad input (InvalidJob), a queue that does not exist (UnknownQueue), a bad limit value "
            "(InvalidConfig, naming the key, also for the limits together: a burst without a rate), or a "
            "queue whose config declares no limit (InvalidConfig)")},
}


def document() -> dict[str, Any]:
    """The OpenAPI document (a new dict each call: callers may change it)."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "shardq serve: console API and metrics", "version": API_VERSION,
                 "description": __doc__.split("\n\n")[0] if __doc__ else ""},
        "paths": copy.deepcopy(_PATHS),
        "components": {"schemas": copy.deepcopy(_SCHEMAS), "securitySchemes": copy.deepcopy(_SECURITY_SCHEMES)},
    }


def routes_in(doc: dict[str, Any]) -> set[tuple[str, str]]:
    """The (method, path) pairs a document describes."""
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
