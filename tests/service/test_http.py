"""The HTTP listener of a real ``shardq serve``: Prometheus metrics, the console's JSON API,
the token and CSRF checks (a request without them changes nothing), and scrapes while a
shard is down, hung, or SIGKILLed and restarting. Also ``shardq worker --metrics``."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardq import limits
from shardq.client.router import shard_for_key
from shardq.config import owner_shard
from shardq.errors import NotFound
from shardq.service.http_auth import Auth

from support.service import REPO, Service, reset_queues, restarted, short_tmpdir, wait_until
from support.http_calls import (request, api)

CONFIG = {"queues": {"default": {}, "once": {"max_deliveries": 1}}}
# For the tests about something other than access: no token, on loopback (docs/operations.md).
OPEN = {"listen": "127.0.0.1:0", "auth": "none"}
TOKEN = "s3cret-token-for-tests-only"
DOCS = os.path.join(REPO, "docs", "operations.md")


def scrape(url: str, headers: dict | None = None) -> dict:
    """{(name, ((label, value), ...)): value} of every sample."""
    status, hdrs, data = request(url, "/metrics", headers=headers)
    assert status == 200, data[:300]
    assert hdrs["Content-Type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(data.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def csrf_of(url, headers=None) -> str:
    return api(url, "/api/session", headers=headers)[1]["csrf"]


def log_in(svc) -> dict:
    """The session cookie for the token the service made (``<data dir>/http-token``), got the
    way a person gets it: opening the URL ``shardq console`` prints."""
    with open(os.path.join(svc.data_dir, "http-token")) as f:
        token = f.read().strip()
    status, hdrs, _ = request(svc.url, f"/login?token={token}")
    assert status == 303 and hdrs["Location"] == "/"
    return {"Cookie": hdrs["Set-Cookie"].split(";")[0]}


def kill_dead(q, queue: str, n: int) -> list[int]:
    ids = [q.enqueue(f"dead {i}".encode(), key=f"d{i}", queue=queue) for i in range(n)]
    got = 0
    while got < n:
        leases = q.dequeue_many(queue, max_jobs=min(n, limits.BATCH_JOBS_MAX), wait=1)
        for lease in leases:
            q.nack(lease, error="boom")
        got += len(leases)
    return ids


@pytest.fixture(scope="module")
def service():
    with Service(shards=2, config=CONFIG) as s:
        s.url = s.http_url()
        s.auth = log_in(s)
        yield s


@pytest.fixture
def svc(service):
    yield service
    with service.connect() as q:
        reset_queues(q, ("default", "once"))


# ---------------------------------------------------------------------------- metrics
def test_metrics_show_queues_shards_and_counters(svc):
    with svc.connect() as q:
        for i in range(5):
            q.enqueue(f"m{i}".encode(), key=f"k{i % 2}")
        lease = q.dequeue(wait=1)
        q.ack(lease)
        lease = q.dequeue(wait=1)
        q.nack(lease, delay=60)
        kill_dead(q, "once", 2)
        q.pause("once")
        st = q.stats()["queues"]
        m = scrape(svc.url)
        q.resume("once")
    for state in ("ready", "delayed", "waiting", "in_flight", "dead"):
        assert total(m, "shardq_queue_jobs", queue="default", state=state) == st["default"][state], state
    assert total(m, "shardq_queue_jobs", queue="once", state="dead") == 2
    assert total(m, "shardq_queue_keys", queue="default") == st["default"]["keys"]
    assert total(m, "shardq_queue_enqueued_total", queue="default") >= 5
    assert total(m, "shardq_queue_acked_total", queue="default") >= 1
    assert total(m, "shardq_queue_nacked_total", queue="default") >= 1
    assert total(m, "shardq_queue_dead_lettered_total", queue="once") >= 2
    assert [v for (n, ls), v in m.items() if n == "shardq_queue_paused" and ("queue", "once") in ls] == [1.0, 1.0]
    assert max(v for (n, ls), v in m.items()
               if n == "shardq_queue_oldest_ready_age_seconds" and ("queue", "default") in ls) > 0
    assert {ls: v for (n, ls), v in m.items() if n == "shardq_shard_up"} == {(("shard", "0"),): 1, (("shard", "1"),): 1}
    assert total(m, "shardq_shard_commit_seconds_count") >= 5
    assert total(m, "shardq_shard_commit_ops_sum") >= total(m, "shardq_shard_commit_ops_count") > 0
    assert total(m, "shardq_shard_restarts_total") == 0
    assert total(m, "shardq_shard_wal_bytes") > 0 and total(m, "shardq_shard_clients") >= 1
    # Records written, and the space the files take: the newest segment is preallocated, so
    # a disk-use alert needs the second (issue 36: the first was documented as the second).
    for shard in ("0", "1"):
        written = total(m, "shardq_shard_wal_bytes", shard=shard)
        assert total(m, "shardq_shard_wal_disk_bytes", shard=shard) > written > 0
    assert total(m, "shardq_shard_loop_iterations_total") > 0
    assert total(m, "shardq_shard_clients_max") == 2 * 4096  # limits.max_connections, per shard
    assert total(m, "shardq_shard_clients_turned_away_total") == 0


def _base(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", name)


def test_every_metric_is_documented_and_the_dashboard_uses_only_real_ones(svc):
    with svc.connect() as q:
        q.enqueue(b"so that queue series exist")
        names = {_base(n) for n, _ in scrape(svc.url)}
    with open(DOCS) as f:
        doc = f.read()
    assert names and not [n for n in sorted(names) if f"`{n}" not in doc]
    with open(os.path.join(REPO, "docs", "grafana-shardq.json")) as f:
        dash = json.load(f)
    used = {_base(n) for p in dash["panels"] for t in p.get("targets", [])
            for n in re.findall(r"shardq_[a-z_]+", t["expr"])}
    worker = {"shardq_worker_jobs", "shardq_worker_handler_seconds", "shardq_worker_in_flight"}
    assert used and used <= names | worker, used - names - worker
    assert not [n for n in sorted(worker) if f"`{n}" not in doc]


# ---------------------------------------------------------------------------- console API
def test_console_api_overview_pause_cancel_redrive_purge(svc):
    csrf = csrf_of(svc.url, svc.auth)
    h = {**svc.auth, "X-CSRF-Token": csrf}
    with svc.connect() as q:
        jid = q.enqueue(b"cancel me", key="api")
        dead = kill_dead(q, "once", 3)
        status, o = api(svc.url, "/api/overview", headers=svc.auth)
        assert status == 200 and [s["up"] for s in o["shards"]] == [True, True]
        assert all(s["pid"] and s["status"] == "ready" for s in o["shards"])
        once = next(x for x in o["queues"] if x["name"] == "once")
        assert once["dead"] == 3 and once["paused"] is False
        assert api(svc.url, "/api/pause", {"queue": "once"}, h) == (200, {"queue": "once", "changed_shards": 2})
        assert q.stats()["queues"]["once"]["paused"] is True
        assert api(svc.url, "/api/resume", {"queue": "once"}, h)[0] == 200
        assert "paused" not in q.stats()["queues"]["once"]
        status, page = api(svc.url, "/api/dead-letters?queue=once&limit=2", headers=svc.auth)
        assert status == 200 and len(page["items"]) == 2 and page["cursor"]
        assert page["items"][0]["error"] == "boom" and page["items"][0]["body"].startswith("dead")
        status, rest = api(svc.url, f"/api/dead-letters?queue=once&limit=2&cursor={page['cursor']}", headers=svc.auth)
        assert sorted(int(d["id"]) for d in page["items"] + rest["items"]) == sorted(dead)
        assert api(svc.url, "/api/redrive", {"queue": "once", "ids": [str(dead[0])]}, h) == (200, {"redriven": 1})
        assert api(svc.url, "/api/purge", {"queue": "once", "ids": [dead[1]]}, h) == (200, {"purged": 1})
        assert [d.job_id for d in q.dead_letters("once")] == [dead[2]]
        status, info = api(svc.url, f"/api/job?id={jid}", headers=svc.auth)
        assert status == 200 and info["job_id"] == str(jid) and info["state"] == "ready"
        assert api(svc.url, "/api/cancel", {"id": str(jid)}, h) == (200, {"id": str(jid), "result": "cancelled"})
        assert api(svc.url, f"/api/job?id={jid}", headers=svc.auth)[0] == 404
        assert api(svc.url, "/api/job?id=abc", headers=svc.auth)[0] == 400
        assert api(svc.url, "/api/cancel", {"id": [1]}, h)[0] == 400
        # Ids are checked in one place (client/routing.py) for the router, the console and
        # the CLI: an id of a shard this 2-shard service lacks is 404 (it was an IndexError
        # and no answer), a digit int() refuses is 400 (it was a ValueError).
        gone = {"error": "NotFound", "message": "job 5 names shard 5; this service has 2"}
        assert api(svc.url, "/api/cancel", {"id": 5}, h) == (404, gone)
        assert api(svc.url, "/api/cancel", {"id": "\u00b2"}, h)[0] == 400
        assert api(svc.url, "/api/job?id=%C2%B2", headers=svc.auth)[0] == 400
        with pytest.raises(NotFound):
            q.cancel(5)
        again = q.dequeue("once", wait=1)
        assert again.job_id == dead[0]
        q.ack(again)
        q.purge_dead_letters("once")


def test_post_limits_at_their_maximum(svc):
    h = {**svc.auth, "X-CSRF-Token": csrf_of(svc.url, svc.auth)}
    with svc.connect() as q:
        dead = kill_dead(q, "once", 50)
        ids = dead + [(i << 10) | (i % 2) for i in range(10**6, 10**6 + limits.BATCH_JOBS_MAX - 50)]
        per_shard = max(sum(1 for j in ids if j & 1 == s) for s in (0, 1))
        assert per_shard <= limits.BATCH_JOBS_MAX
        assert api(svc.url, "/api/purge", {"queue": "once", "ids": ids}, h) == (200, {"purged": 50})
        big = [(i << 10) for i in range(limits.BATCH_JOBS_MAX + 1)]
        status, err = api(svc.url, "/api/purge", {"queue": "once", "ids": big}, h)
        assert status == 400 and err["error"] == "InvalidJob"
        status, _, _ = request(svc.url, "/api/pause", "POST", b"{" + b" " * (1024 * 1024) + b"}",
                               {"Content-Type": "application/json", **h})
        assert status == 413
        assert "paused" not in q.stats()["queues"].get("default", {})


def test_with_auth_none_only_same_origin_csrf_posts_from_a_loopback_host_change_anything():
    with Service(shards=1, config=dict(CONFIG, http=OPEN)) as svc, svc.connect() as q:
        svc.url = svc.http_url()
        q.enqueue(b"keep me")
        csrf = csrf_of(svc.url)
        attempts = [
            ({}, 403),                                                       # no CSRF header
            ({"X-CSRF-Token": "0" * 64}, 403),                               # wrong one
            ({"X-CSRF-Token": csrf, "Origin": "http://evil.example"}, 403),  # another site
            ({"X-CSRF-Token": csrf, "Origin": "null"}, 403),
            ({"X-CSRF-Token": csrf, "Host": "evil.example"}, 403),           # DNS rebinding
            # this host and port, a scheme no page of it is served by: another origin
            ({"X-CSRF-Token": csrf, "Origin": svc.url.rstrip("/").replace("http://", "ws://")}, 403),
        ]
        for headers, expected in attempts:
            assert api(svc.url, "/api/pause", {"queue": "default"}, headers)[0] == expected, headers
        # its own origin, exactly: taken (a resume, which changes nothing here)
        assert api(svc.url, "/api/resume", {"queue": "default"},
                   {"X-CSRF-Token": csrf, "Origin": svc.url.rstrip("/")})[0] == 200
        status, _, _ = request(svc.url, "/api/pause", "POST", b"queue=default",
                               {"X-CSRF-Token": csrf, "Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415                                                 # a plain form cannot do it
        assert request(svc.url, "/api/pause?queue=default")[0] == 405  # a POST route: GET never changes state
        assert request(svc.url, "/api/overview", headers={"Host": "attacker.example:80"})[0] == 403
        assert "paused" not in q.stats()["queues"]["default"]
        assert q.dequeue(wait=1).body == b"keep me"


@pytest.mark.parametrize("origin, ok", [
    (None, True),                                  # no Origin sent (not a browser, or an old one)
    ("http://127.0.0.1:7781", True),               # this listener, exactly
    ("HTTP://127.0.0.1:7781", True),               # the scheme and host are case-insensitive
    ("https://127.0.0.1:7781", True),              # through its TLS proxy (docs/operations.md)
    ("ws://127.0.0.1:7781", False),                # same host and port, a scheme no page is served by
    ("wss://127.0.0.1:7781", False),
    ("://127.0.0.1:7781", False),
    ("127.0.0.1:7781", False),
    ("http://127.0.0.1:7782", False),              # another port
    ("http://127.0.0.1", False),
    ("http://127.0.0.1:7781/", False),             # an Origin has no path
    ("http://evil.example", False),
    ("null", False),
])
def test_the_csrf_origin_must_be_this_listeners_scheme_host_and_port(origin, ok):
    """The tester's origin_scheme.sh: a ws:// Origin (or any scheme) of the listener's host
    and port passed, since only what follows "://" was compared with the Host. http://, or
    https:// through the TLS proxy the docs put in front of it, and exactly the Host."""
    auth = Auth("t" * 32)
    headers = {"Host": "127.0.0.1:7781", "X-CSRF-Token": auth.csrf}
    if origin is not None:
        headers["Origin"] = origin
    assert auth.csrf_ok(headers, "cookie") is ok
    assert auth.csrf_ok({k: v for k, v in headers.items() if k != "Host"}, "cookie") is (origin is None)
    assert auth.csrf_ok({**headers, "X-CSRF-Token": "0" * 64}, "cookie") is False
    assert auth.csrf_ok({}, "bearer") is True  # a bearer token is never sent by a browser by itself


def test_with_a_token_nothing_works_without_it(monkeypatch):
    monkeypatch.setenv("SHARDQ_HTTP_TOKEN", TOKEN)  # the env var, as an operator would set it
    with Service(shards=1, config=CONFIG) as s, s.connect() as q:
        url = s.http_url()
        jid = q.enqueue(b"precious", key="t")
        for method, path, body in (("GET", "/api/overview", None),
                                   ("GET", "/api/session", None), ("GET", f"/api/job?id={jid}", None),
                                   ("POST", "/api/pause", {"queue": "default"}),
                                   ("POST", "/api/cancel", {"id": str(jid)})):
            for headers in ({}, {"Authorization": "Bearer wrong-token-0000000"},
                            {"Cookie": "shardq_session=forged"}):
                status, _, data = request(url, path, method, body, headers)
                assert status == 401, (method, path, headers, status)
                assert b"precious" not in data
        status, hdrs, _ = request(url, "/")
        assert status == 303 and hdrs["Location"] == "/login"
        assert request(url, "/login")[0] == 200
        assert request(url, "/metrics")[0] == 200  # open on loopback (metrics_public), like the default
        status, hdrs, _ = request(url, "/login", "POST", b"token=wrong",
                                  {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 303 and "Set-Cookie" not in hdrs
        assert "paused" not in q.stats()["queues"]["default"] and q.job(jid)["state"] == "ready"
        # The bearer token: scripts and Prometheus (no CSRF needed: a browser never sends it).
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert total(scrape(url, bearer), "shardq_queue_jobs", queue="default", state="ready") == 1
        assert api(url, "/api/pause", {"queue": "default"}, bearer)[0] == 200
        assert q.stats()["queues"]["default"]["paused"] is True
        # The login cookie: a person in a browser; POSTs then need the CSRF value too.
        status, hdrs, _ = request(url, "/login", "POST", f"token={TOKEN}".encode(),
                                  {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 303 and hdrs["Location"] == "/"
        cookie = {"Cookie": hdrs["Set-Cookie"].split(";")[0]}
        assert TOKEN not in hdrs["Set-Cookie"] and "HttpOnly" in hdrs["Set-Cookie"]
        assert request(url, "/", headers=cookie)[0] == 200
        assert api(url, "/api/resume", {"queue": "default"}, cookie)[0] == 403
        assert q.stats()["queues"]["default"]["paused"] is True
        csrf = csrf_of(url, cookie)
        assert api(url, "/api/resume", {"queue": "default"}, {**cookie, "X-CSRF-Token": csrf})[0] == 200
        assert "paused" not in q.stats()["queues"]["default"]
        status, hdrs, _ = request(url, "/logout", "POST", b"", cookie)
        assert status == 303 and "Max-Age=0" in hdrs["Set-Cookie"]


def test_serve_refuses_a_listener_beyond_loopback_without_a_token(monkeypatch):
    monkeypatch.delenv("SHARDQ_HTTP_TOKEN", raising=False)
    tmp = short_tmpdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for http_cfg, words in (('listen = "0.0.0.0:0"', "not a loopback address"),
                            ('listen = "127.0.0.1:0"\ntoken = "short"', "16 characters"),
                            ('listen = "0.0.0.0:0"\nauth = "none"', "loopback listen address only")):
        cfg = os.path.join(tmp, "c.toml")
        with open(cfg, "w") as f:
            f.write(f"[http]\n{http_cfg}\n")
        r = subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--config", cfg, "--data-dir",
                            os.path.join(tmp, "d"), "--shards", "1"], capture_output=True, text=True,
                           timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert r.returncode == 5 and words in r.stderr, r.stderr[-2000:]
        assert "event=spawn" not in r.stderr  # refused before any shard started


# ---------------------------------------------------------------------------- shards down
def test_a_shard_left_down_shows_up_0_and_the_console_still_works():
    # "owned": a limited queue whose owner is shard 1, the one that goes down
    cfg = dict(CONFIG, queues={**CONFIG["queues"], "owned": {"concurrency": 1}},
               service={"restart_backoff_max": 60}, http=OPEN)
    assert owner_shard("owned", 2) == 1
    with Service(shards=2, config=cfg) as s, s.connect(retry_s=1) as q:
        url = s.http_url()
        key0 = next(k for k in (f"x{i}" for i in range(100)) if shard_for_key(k, 2) == 0)
        q.enqueue(b"on shard 0", key=key0)
        q.pause("owned")
        q.resume("owned")  # held by both shards now, shard 0 idle
        shard_dir = os.path.join(s.data_dir, "shard-1")
        os.rename(shard_dir, shard_dir + ".away")
        open(shard_dir, "w").close()  # a file where its directory should be: every restart fails
        os.kill(q.ping()[1], signal.SIGKILL)
        m = wait_until(lambda: (lambda m: total(m, "shardq_shard_status", shard="1", status="restarting",
                                                reason="io_error") == 1 and m)(scrape(url)),
                       20, 0.1, "shard 1 reported restarting, and why")
        t0 = time.monotonic()
        m = scrape(url)
        assert time.monotonic() - t0 < 5
        assert total(m, "shardq_shard_up", shard="1") == 0 and total(m, "shardq_shard_up", shard="0") == 1
        assert total(m, "shardq_shard_restarts_total", shard="1") >= 2 and total(m, "shardq_shard_failed") == 0
        assert total(m, "shardq_queue_jobs", queue="default", shard="0", state="ready") == 1
        assert total(m, "shardq_shard_replay_seconds", shard="1") >= 0  # the last start's, from the supervisor
        status, o = api(url, "/api/overview")
        assert status == 200 and [sh["up"] for sh in o["shards"]] == [True, False]
        assert o["shards"][1]["status"] in ("restarting", "starting"), o["shards"][1]
        assert "cannot open its log" in o["shards"][1]["reason"] and "code=4" in o["shards"][1]["last_exit"]
        assert next(x for x in o["queues"] if x["name"] == "default")["ready"] == 1
        # each shard's own totals, for the charts; none for the one down
        assert o["shards"][0]["totals"]["ready"] == 1 and o["shards"][1]["totals"] is None
        # the owner down: said so, never shard 0's idle figures instead (stats the same)
        unknown = {"owner": 1, "owner_down": True}
        assert next(x for x in o["queues"] if x["name"] == "owned")["limits"] == unknown
        assert q.stats()["queues"]["owned"]["limits"] == unknown
        status, page = api(url, "/api/dead-letters?queue=default")
        assert status == 200 and page["skipped_shards"] == [1]
        status, err = api(url, "/api/pause", {"queue": "default"}, {"X-CSRF-Token": csrf_of(url)})
        assert status == 503 and err["error"] in ("ShardUnavailable", "OutcomeUnknown")
        assert q.dequeue(wait=0.3) is None  # shard 0 got the pause; pausing is idempotent, redo it later
        # paused on the one shard up, shard 1's state not known: partly paused, not "paused"
        row = next(x for x in api(url, "/api/overview")[1]["queues"] if x["name"] == "default")
        assert (row["paused"], row["partly_paused"], row["paused_shards"]) == (True, True, 1)


def test_scrapes_keep_working_while_a_shard_hangs_and_is_sigkilled_and_restarts():
    cfg = dict(CONFIG, service={"restart_backoff_max": 0.5, "health_timeout": 30}, http=OPEN)
    with Service(shards=2, config=cfg) as s, s.connect(retry_s=20) as q:
        url = s.http_url()
        results: list = []
        stop = threading.Event()

        def scraper():
            while not stop.is_set():
                for path in ("/metrics", "/api/overview"):
                    try:
                        status, _, data = request(url, path, timeout=10)
                        ok = status == 200 and (b"shardq_shard_up{shard=\"1\"}" in data if path == "/metrics"
                                                else len(json.loads(data)["shards"]) == 2)
                        results.append((path, status, ok))
                    except Exception as e:  # noqa: BLE001 - a failed request is a failure of the test
                        results.append((path, None, repr(e)))

        th = threading.Thread(target=scraper)
        th.start()
        try:
            for round_ in range(2):
                pid = q.ping()[1]
                os.kill(pid, signal.SIGSTOP)  # hung: the scrape must not wait for it
                t0 = time.monotonic()
                m = scrape(url)
                assert time.monotonic() - t0 < 5
                assert total(m, "shardq_shard_up", shard="1") == 0 and total(m, "shardq_shard_up", shard="0") == 1
                seen = len(results)  # the scraper's own requests must also complete while it hangs
                wait_until(lambda: len(results) >= seen + 2, 30, 0.05, "two scrapes while the shard hangs")
                os.kill(pid, signal.SIGKILL)
                restarted(s, 1, pid)
                m = wait_until(lambda: (lambda m: total(m, "shardq_shard_up", shard="1") == 1 and m)(scrape(url)),
                               20, 0.05, "shard 1 up again")
                assert total(m, "shardq_shard_restarts_total", shard="1") == round_ + 1
                seen = len(results)
                wait_until(lambda: len(results) >= seen + 2, 30, 0.05, "two scrapes after the restart")
        finally:
            stop.set()
            th.join(30)
        bad = [r for r in results if r[1] != 200 or r[2] is not True]
        assert len(results) >= 8 and not bad, bad[:5]


# ---------------------------------------------------------------------------- worker metrics
HANDLER = textwrap.dedent("""
    def handle(ctx):
        if ctx.body == b"fail":
            raise ValueError("asked to fail")
""")


def test_worker_metrics_count_jobs_by_task_and_outcome(svc):
    tmp = short_tmpdir()
    with open(os.path.join(tmp, "metrics_handler.py"), "w") as f:
        f.write(HANDLER)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = os.path.join(tmp, "worker.log")
    with open(log_path, "wb") as log, svc.connect() as q:
        for i in range(5):
            q.enqueue(f"ok {i}".encode(), queue="wm")
        q.enqueue(b"fail", queue="wm")
        proc = subprocess.Popen([sys.executable, "-m", "shardq.cli", "worker", "metrics_handler:handle", "--queue",
                                 "wm", "--connect", svc.data_dir, "--metrics", "127.0.0.1:0", "--log-level",
                                 "WARNING"], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            def address():
                with open(log_path) as f:
                    found = re.search(r"metrics at (http://\S+)/metrics", f.read())
                return found and found.group(1)
            url = wait_until(address, 30, 0.05, "the worker's metrics address")
            task = {"task": "metrics_handler:handle"}
            m = wait_until(lambda: (lambda m: total(m, "shardq_worker_jobs_total", outcome="done", **task) == 5
                                    and total(m, "shardq_worker_jobs_total", outcome="failed", **task) >= 1
                                    and m)(scrape(url)), 30, 0.1, "the worker's counts")
            assert total(m, "shardq_worker_handler_seconds_count", **task) >= 6
            assert ("shardq_worker_in_flight", ()) in m
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------- config
def test_the_http_section_is_validated_and_its_token_never_leaves_the_process():
    from shardq.config import Config, parse
    from shardq.errors import InvalidConfig
    assert Config().http.listen == "127.0.0.1:7781"
    cfg = parse({"http": {"listen": "[::1]:0", "token": "x" * 16}})
    assert cfg.http.listen == "[::1]:0"
    assert cfg.to_dict()["http"] == {"listen": "[::1]:0", "auth": "token", "metrics_public": True}
    assert "x" * 16 not in repr(cfg)
    assert parse({"http": {"listen": ""}}).http.listen == ""
    for bad, words in (({"listen": "7781"}, "host:port"), ({"listen": "h:99999"}, "host:port"),
                       ({"listen": 7781}, "host:port"), ({"token": "x" * 15}, "16 characters"),
                       ({"port": 1}, "http.port: unknown key")):
        with pytest.raises(InvalidConfig, match=words):
            parse({"http": bad})
