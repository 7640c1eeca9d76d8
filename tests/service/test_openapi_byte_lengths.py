"""The OpenAPI document's string lengths say what the server counts.

JSON Schema's ``maxLength`` counts characters; the server limits queue names, workflow ids
and progress notes in bytes of UTF-8 (a character outside ASCII takes 2 to 4). The document
gave the byte limit as ``maxLength`` alone (for a note, without saying bytes), so a name of
65 to 128 characters of "é" was valid by the document and refused by the server. A byte
length cannot be stated in JSON Schema: ``maxLength`` stays the bound in characters that every
accepted string keeps, and each description states the limit in bytes and that a shorter
string may still be refused. The second test holds the server to that description."""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import jsonschema

from shardq import limits
from shardq.service.console import openapi

from support.http_calls import request
from support.service import Service

TOKEN = "bytes-token-" + "t" * 32
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _byte_limited(doc: dict[str, Any]) -> dict[str, tuple[dict[str, Any], int]]:
    """Where the document states a string the server limits in bytes: its schema, and the limit."""
    schemas, paths = doc["components"]["schemas"], doc["paths"]

    def query(path: str, name: str) -> dict[str, Any]:
        [param] = [p for p in paths[path]["get"]["parameters"] if p["name"] == name]
        return param["schema"]

    queue, wf_id, note = limits.QUEUE_NAME_BYTES_MAX, limits.BARRIER_ID_BYTES_MAX, limits.PROGRESS_NOTE_BYTES_MAX
    return {"QueueRequest.queue": (schemas["QueueRequest"]["properties"]["queue"], queue),
            "IdsRequest.queue": (schemas["IdsRequest"]["properties"]["queue"], queue),
            "LimitsRequest.queue": (schemas["LimitsRequest"]["properties"]["queue"], queue),
            "GET /api/dead-letters ?queue": (query("/api/dead-letters", "queue"), queue),
            "GET /api/workflow ?id": (query("/api/workflow", "id"), wf_id),
            "Workflow.id": (schemas["Workflow"]["properties"]["id"], wf_id),
            "LiveJob.note": (schemas["LiveJob"]["properties"]["note"], note),
            "SucceededJob.note": (schemas["SucceededJob"]["properties"]["note"], note),
            "WorkflowStep.note": (schemas["WorkflowStep"]["properties"]["note"], note)}


def _strings_with_max_length(node: Any, where: str = "") -> list[str]:
    """Where the document has a schema with maxLength."""
    if isinstance(node, dict):
        found = [where] if "maxLength" in node else []
        return found + [w for k, v in node.items() for w in _strings_with_max_length(v, f"{where}/{k}")]
    if isinstance(node, list):
        return [w for i, v in enumerate(node) for w in _strings_with_max_length(v, f"{where}/{i}")]
    return []


def test_every_byte_limit_is_stated_in_bytes_and_maxlength_is_the_bound_in_characters():
    doc = openapi.document()
    for what, (schema, most) in _byte_limited(doc).items():
        assert schema["maxLength"] == most, what  # the most characters an accepted string has
        description = schema.get("description", "")
        assert "maxLength counts characters" in description, (what, description)
        assert f"at most {most} bytes of UTF-8" in description, (what, description)
        validator = jsonschema.Draft202012Validator(schema)
        over = "é" * (most // 2 + 1)  # within maxLength, over the byte limit
        assert validator.is_valid(over) and len(over.encode()) > most, what
        if not what.endswith(".note") and not what.startswith("Workflow."):  # sent: the server refuses it
            assert "refused (400)" in description, (what, description)
    # Every maxLength of the document is one of these, or the rate's text (not a byte limit).
    rates = {f"/components/schemas/LimitsRequest/properties/values/oneOf/1/properties/{k}" for k in
             ("rate", "group_rate")}
    assert len(_strings_with_max_length(doc)) == len(_byte_limited(doc)) + len(rates)


def test_the_server_refuses_a_string_within_maxlength_but_over_its_byte_limit(tmp_path):
    """What the descriptions say, against a real listener: a queue name or workflow id at
    its byte limit in 2-byte characters is taken, one character more (still well within
    maxLength) is a 400, not a 5xx."""
    at_queue = "é" * (limits.QUEUE_NAME_BYTES_MAX // 2)
    at_wf = "é" * (limits.BARRIER_ID_BYTES_MAX // 2)
    with Service(shards=2, config={"http": {"listen": "127.0.0.1:0", "token": TOKEN}}) as svc:
        url = svc.http_url()

        def post(action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            status, _, data = request(url, f"/api/{action}", "POST", body, BEARER)
            return status, json.loads(data)

        def get(path: str) -> tuple[int, dict[str, Any]]:
            status, _, data = request(url, path, headers=BEARER)
            return status, json.loads(data)

        with svc.connect() as q:  # (the console's actions make no queue by naming it)
            q.enqueue(b"x", queue=at_queue)
        assert post("pause", {"queue": at_queue})[0] == 200
        assert post("resume", {"queue": at_queue})[0] == 200
        assert get(f"/api/dead-letters?queue={quote(at_queue)}")[0] == 200
        assert get(f"/api/workflow?id={quote(at_wf)}")[0] == 404  # a possible id: no record of it
        for over in (at_queue + "é", "é" * limits.QUEUE_NAME_BYTES_MAX):
            for action in ("pause", "resume"):
                status, reply = post(action, {"queue": over})
                assert status == 400 and str(limits.QUEUE_NAME_BYTES_MAX) in reply["message"], (action, reply)
            for action in ("redrive", "purge"):
                status, reply = post(action, {"queue": over, "ids": ["1024"]})
                assert status == 400, (action, reply)
            status, reply = get(f"/api/dead-letters?queue={quote(over)}")
            assert status == 400, reply
        for over in (at_wf + "é", "é" * limits.BARRIER_ID_BYTES_MAX):
            status, reply = get(f"/api/workflow?id={quote(over)}")
            assert status == 400 and str(limits.BARRIER_ID_BYTES_MAX) in reply["message"], reply
