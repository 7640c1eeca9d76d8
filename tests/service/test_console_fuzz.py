"""The HTTP API of ``shardq serve`` against its OpenAPI document (issue 32, section 6).

* The document (shardq/service/console/openapi.py, served at ``GET /openapi.json``) names
  exactly the routes the listener dispatches, and is valid OpenAPI.
* schemathesis fuzzes a real ``shardq serve`` from the document, with the token: valid and
  invalid parameters and bodies, undeclared methods, requests without the token. No reply
  is a 5xx or holds a traceback, every reply conforms to the document (status, content
  type, JSON shape), invalid input is refused, and the service logs no handler error.
* Without the token, or with the session cookie but without the right ``X-CSRF-Token`` (or
  with another site's ``Origin``), every state-changing call is refused (401/403) and the
  service's state (queues, pause flags, jobs, dead letters, the shards' log bytes) is as
  before: for the bodies schemathesis draws and for bodies that name real targets.

``SHARDQ_FUZZ_EXAMPLES`` sets the examples per operation (default 25, which keeps this file
near 20 s; e.g. 1000 for a long run). The fixed cases at the end are the bugs this found.
"""
from __future__ import annotations

import base64
import json
import os
import socket
from urllib.parse import urlsplit

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate as validate_openapi
from schemathesis import GenerationMode

from shardq import limits
from shardq.errors import QueueFull, ShardUnavailable
from shardq.service.console import openapi
from shardq.service.http_server import HEADERS_MAX, _Handler

from support.service import Service
from support.http_calls import request

EXAMPLES = int(os.environ.get("SHARDQ_FUZZ_EXAMPLES", "25"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
TOKEN = "fuzz-token-" + "t" * 32
BEARER = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = {"http": {"listen": "127.0.0.1:0", "token": TOKEN},
          "queues": {"guarded-dead": {"max_deliveries": 1}}}
TRACEBACK = "Traceback (most recent call last)"


def _schema(*modes: GenerationMode):
    schema = schemathesis.openapi.from_dict(openapi.document())
    # The credentials are the test's: no generated Cookie or X-CSRF-Token header.
    schema.config.generation.update(modes=list(modes), with_security_parameters=False)
    return schema


SCHEMA = _schema(GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
ACTIONS = _schema(GenerationMode.POSITIVE).include(method="POST", path_regex="^/api/")


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config=CONFIG) as s:
        s.url = s.http_url()
        s.base = s.url.rstrip("/")
        with s.connect() as q:
            s.ready_job = q.enqueue(b"guarded", key="g", queue="guarded")
            q.enqueue(b"doomed", key="d", queue="guarded-dead")
            q.nack(q.dequeue("guarded-dead"), error="boom")
            [s.dead_job] = [d.job_id for d in q.dead_letters("guarded-dead")]
        status, hdrs, _ = request(s.url, f"/login?token={TOKEN}")
        assert status == 303
        s.cookie = hdrs["Set-Cookie"].split(";")[0]
        s.csrf = json.loads(request(s.url, "/api/session", headers=BEARER)[2])["csrf"]
        with s.connect() as s.q:
            yield s
        log = open(s.log_path, encoding="utf-8", errors="replace").read()
        assert TRACEBACK not in log and "http-handler-error" not in log, log[-3000:]


def state(svc) -> dict:
    """What a refused request must not change (the shards' log bytes catch any write)."""
    q = svc.q
    st = q.stats()
    return {"queues": st["queues"], "shards": [(sh["jobs"], sh["wal_bytes"]) for sh in st["shards"]],
            "dead": sorted(d.job_id for d in q.dead_letters("guarded-dead")),
            "ready": q.job(svc.ready_job)["state"]}


# ---------------------------------------------------------------------------- the document
def test_the_document_names_exactly_the_routes_the_listener_dispatches():
    assert openapi.routes_in(openapi.document()) == _Handler.routes()


def test_the_document_is_valid_openapi_and_every_reply_is_described():
    doc = openapi.document()
    validate_openapi(doc)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "security" in op, (method, path)
            if path.startswith("/api/"):
                assert {"200", "401", "403"} <= op["responses"].keys(), (method, path)


def test_the_listener_serves_the_document_without_the_token(svc):
    status, hdrs, data = request(svc.url, "/openapi.json")
    assert status == 200 and hdrs["Content-Type"] == "application/json"
    assert json.loads(data) == openapi.document()
    assert hdrs["Content-Security-Policy"] and hdrs["X-Content-Type-Options"] == "nosniff"


# ---------------------------------------------------------------------------- the fuzz, without credentials
def test_the_targets_of_the_refusals_are_real(svc):
    """The refusals below name these; they run before the fuzz with the token, which may
    cancel or purge anything."""
    q = svc.q
    assert q.job(svc.ready_job)["state"] == "ready" and q.job(svc.dead_job)["state"] == "dead"
    assert "paused" not in q.stats()["queues"]["guarded"]


def bad_credentials(svc) -> list[tuple[str, dict, int]]:
    """(what, headers, the status that refuses it) for a state-changing POST."""
    ok = {"Cookie": svc.cookie, "X-CSRF-Token": svc.csrf}
    basic = base64.b64encode(f"shardq:{TOKEN}".encode()).decode()
    return [("nothing", {}, 401),
            ("a wrong token", {"Authorization": "Bearer " + "w" * 43}, 401),
            ("the token and a byte more", {"Authorization": f"Bearer {TOKEN}x"}, 401),
            ("the token as basic auth", {"Authorization": f"Basic {basic}"}, 401),
            ("the token without the scheme's space", {"Authorization": f"Bearer{TOKEN}"}, 401),
            ("the CSRF header alone", {"X-CSRF-Token": svc.csrf}, 401),
            ("a forged session cookie", {**ok, "Cookie": "shardq_session=" + "0" * 64}, 401),
            ("the cookie without the CSRF header", {"Cookie": svc.cookie}, 403),
            ("the cookie with a wrong CSRF header", {**ok, "X-CSRF-Token": svc.csrf[:-1] + "0"}, 403),
            ("the cookie with another site's Origin", {**ok, "Origin": "http://evil.example"}, 403),
            ("the cookie with a null Origin", {**ok, "Origin": "null"}, 403)]


def assert_refused(svc, response, expected: int, what: str) -> None:
    assert response.status_code == expected, (what, response.status_code, response.text[:200])
    body = response.json()
    assert set(body) == {"error", "message"} and TRACEBACK not in response.text, (what, body)


@ACTIONS.parametrize()
@fuzz
def test_without_the_token_or_the_csrf_header_a_post_changes_nothing(case, svc):
    before = state(svc)
    for what, headers, expected in bad_credentials(svc):
        assert_refused(svc, case.call(base_url=svc.base, headers=headers), expected, what)
    query = case.call(base_url=svc.base, params={"token": TOKEN})  # the token where only GET /login reads it
    assert_refused(svc, query, 401, "the token in the query")
    assert state(svc) == before


@pytest.mark.parametrize("action", ["pause", "resume", "cancel", "redrive", "purge"])
def test_without_the_token_or_the_csrf_header_a_post_naming_real_targets_changes_nothing(svc, action):
    """The drawn bodies name queues and jobs that mostly do not exist: these name the
    service's own (a ready job, a dead letter, a queue with both)."""
    body = {"pause": {"queue": "guarded"}, "resume": {"queue": "guarded"}, "cancel": {"id": str(svc.ready_job)},
            "redrive": {"queue": "guarded-dead", "ids": [str(svc.dead_job)]},
            "purge": {"queue": "guarded-dead", "ids": [svc.dead_job]}}[action]
    if action == "resume":  # paused first, with the token, so that a resume would show
        assert requests.post(f"{svc.base}/api/pause", json={"queue": "guarded"}, headers=BEARER).status_code == 200
    before = state(svc)
    for what, headers, expected in bad_credentials(svc):
        assert_refused(svc, requests.post(f"{svc.base}/api/{action}", json=body, headers=headers), expected, what)
    assert state(svc) == before
    if action == "resume":
        assert requests.post(f"{svc.base}/api/resume", json={"queue": "guarded"}, headers=BEARER).status_code == 200


def test_without_the_token_no_read_gives_anything_away(svc):
    for method, path in sorted(openapi.routes_in(openapi.document())):
        if method != "GET" or not path.startswith("/api/"):
            continue
        status, _, data = request(svc.url, f"{path}?queue=guarded&id={svc.ready_job}")
        assert status == 401 and b"guarded" not in data and str(svc.ready_job).encode() not in data, path


# ---------------------------------------------------------------------------- the fuzz, with the token
@SCHEMA.parametrize()
@fuzz
def test_the_api_answers_as_documented_and_never_with_a_server_error(case, svc):
    """Every reply as the document says (status, content type, schema), no 5xx, invalid input
    refused, requests without the token refused; the schema-valid but semantic refusals (an
    id of a shard this service lacks, a cursor past its shards) are 4xx as documented."""
    response = case.call(base_url=svc.base, headers=BEARER)
    assert TRACEBACK not in response.text
    case.validate_response(response, headers=BEARER,
                           excluded_checks=[schemathesis.checks.positive_data_acceptance])


# ---------------------------------------------------------------------------- found by the fuzz
# Each failed before its fix. schemathesis found the 501 pages and the 404 for a route's
# other method, and the blank query value read as the default. Writing the document to the
# server's checks found the ignored unknown fields, the ids past the maximum and the numbers
# int() takes; reading the same few handler lines, the requests schemathesis cannot send
# (a target that is no URL, asset names the file system refuses, JSON nested past the
# parser's depth, http.server's own errors) and the 500 for QueueFull.
def raw(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` as it is on a new connection; everything the listener answers until it
    closes ``b""``: it dropped the connection without a reply."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def status_of(reply: bytes) -> int:
    assert reply, "the listener closed the connection without a reply"
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "QUERY", "FROB"])
def test_a_method_other_than_get_or_post_is_405_with_allow_not_a_501_page(svc, method):
    """http.server answered 501 with an HTML page without the security headers."""
    status, hdrs, data = request(svc.url, "/api/pause", method, headers=BEARER)
    assert (status, hdrs["Allow"], json.loads(data)["error"]) == (405, "POST", "MethodNotAllowed")
    assert hdrs["Content-Security-Policy"]
    assert request(svc.url, "/api/nothing-here", method, headers=BEARER)[0] == 404


def test_head_gets_a_head_and_get_or_post_on_the_others_route_is_405(svc):
    status, hdrs, data = request(svc.url, "/api/overview", "HEAD", headers=BEARER)
    assert (status, hdrs["Allow"], data) == (405, "GET", b"")
    assert request(svc.url, "/api/overview", "POST", {}, headers=BEARER)[0] == 405       # was 404
    status, hdrs, _ = request(svc.url, "/api/pause", headers=BEARER)
    assert (status, hdrs["Allow"]) == (405, "POST")


def test_an_empty_query_value_is_that_value_not_the_default(svc):
    """"?queue=" read as no queue: the page of the default queue came back."""
    status, body = request(svc.url, "/api/dead-letters?queue=", headers=BEARER)[::2]
    assert status == 400 and json.loads(body)["error"] == "InvalidJob"


@pytest.mark.parametrize("query", ["limit=+5", "limit=%205", "limit=5_0", "limit=%D9%A5", "cursor=+0:",
                                   "cursor=0:%201", "cursor=0:1_0"])
def test_numbers_in_the_query_are_ascii_digits_only(svc, query):
    """int() also takes " 5", "+5", "5_0" and Arabic-Indic digits: the document's pattern does not."""
    assert request(svc.url, f"/api/dead-letters?queue=guarded-dead&{query}", headers=BEARER)[0] == 400


@pytest.mark.parametrize("action, body", [("pause", {"queue": "guarded", "queues": ["x"]}),
                                          ("cancel", {"id": "1", "ids": ["2"]}),
                                          ("purge", {"queue": "guarded-dead", "ids": ["1"], "all": True})])
def test_a_field_an_action_does_not_take_is_refused_and_nothing_happens(svc, action, body):
    """A typo was ignored: {"queue": ..., "queues": [...]} paused the queue."""
    before = state(svc)
    r = requests.post(f"{svc.base}/api/{action}", json=body, headers=BEARER)
    assert r.status_code == 400 and "unknown field" in r.json()["message"]
    assert state(svc) == before


def test_ids_past_the_documented_maximum_are_refused_spread_over_shards_too(svc):
    # half on each shard (each within the shard's limit), none of them a job of this service
    ids = [(i << 10) | (i % 2) for i in range(10**6, 10**6 + limits.BATCH_JOBS_MAX + 1)]
    r = requests.post(f"{svc.base}/api/purge", json={"queue": "guarded-dead", "ids": ids}, headers=BEARER)
    assert r.status_code == 400 and str(limits.BATCH_JOBS_MAX) in r.json()["message"]
    r = requests.post(f"{svc.base}/api/purge", json={"queue": "guarded-dead", "ids": ids[:-1]}, headers=BEARER)
    assert r.json() == {"purged": 0}


@pytest.mark.parametrize("target", [b"http://[x/api/overview", b"http://[::1/api/pause"])
def test_a_request_target_that_is_no_url_is_400_not_a_dropped_connection(svc, target):
    """urlsplit raised ValueError ("Invalid IPv6 URL") in the handler: no reply at all."""
    for method in (b"GET", b"POST"):
        reply = raw(svc.url, method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert status_of(reply) == 400 and b'"error": "InvalidJob"' in reply


@pytest.mark.parametrize("name", [b"console\x00.css", b"a" * 300 + b".css"])
def test_an_asset_name_the_file_system_refuses_is_404_not_a_dropped_connection(svc, name):
    """A NUL raised ValueError, a name past NAME_MAX raised OSError (ENAMETOOLONG): no reply."""
    assert status_of(raw(svc.url, b"GET /static/" + name + b" HTTP/1.1\r\nHost: x\r\n\r\n")) == 404


def test_json_nested_past_the_parsers_depth_is_400_not_a_dropped_connection(svc):
    """json.loads raised RecursionError, which is no ValueError: the handler died."""
    status, _, data = request(svc.url, "/api/pause", "POST", b"[" * 100_000,
                              {**BEARER, "Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["message"] == "body is not JSON"


def test_a_malformed_request_line_gets_the_apis_json_error_with_the_security_headers(svc):
    """http.server's own error page was HTML, without Content-Security-Policy."""
    headers = b"".join(b"X-%d: y\r\n" % i for i in range(100))  # http.client takes 100 at most
    reply = raw(svc.url, b"GET /api/overview HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert status_of(reply) == 431 and b"Content-Security-Policy" in head and b"X-Frame-Options: DENY" in head
    assert json.loads(body)["error"] == "RequestHeaderFieldsTooLarge" and b"Connection: close" in head
    # at the maximum (HEADERS_MAX fields, Host included) it is served
    reply = raw(svc.url, b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers[:-len(b"X-99: y\r\n")]
                + b"\r\n")
    assert status_of(reply) == 200 and HEADERS_MAX == 100


@pytest.mark.parametrize("error, status", [(QueueFull("full"), 503), (ShardUnavailable("down"), 503)])
def test_a_full_or_missing_shard_is_503_not_500(error, status):
    """QueueFull (a new queue past QUEUES_MAX) fell through to 500, a server error."""
    sent = []
    handler = _Handler.__new__(_Handler)
    handler._json = lambda code, obj, headers=(): sent.append((int(code), obj))

    def raises():
        raise error
    handler._call(raises)
    assert sent == [(status, {"error": type(error).__name__, "message": str(error)})]
