"""The console's token by default (issue 32, section 1): with no ``[http] token`` and no
``SHARDQ_HTTP_TOKEN``, ``shardq serve`` makes one in ``<data dir>/http-token`` (0600) and
wants it on loopback too; ``shardq console`` and the startup line print the URL that logs
in; ``/metrics`` stays open on loopback unless ``metrics_public = false``; ``auth = "none"``
is the loopback-only opt-out."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from shardq.config import parse
from shardq.errors import InvalidConfig

from support.service import REPO, Service, short_tmpdir
from support.http_calls import api, request

CONFIG = {"queues": {"default": {}}}
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop("SHARDQ_HTTP_TOKEN", None)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args], capture_output=True, text=True,
                          timeout=60, env=ENV, stdin=subprocess.DEVNULL)


def logged_in(login_url: str) -> dict:
    """The session cookie that opening ``login_url`` (as a browser would) sets."""
    path = login_url.split("/", 3)[3]
    status, hdrs, _ = request(login_url, "/" + path)
    assert status == 303 and hdrs["Location"] == "/", (status, dict(hdrs))
    return {"Cookie": hdrs["Set-Cookie"].split(";")[0]}


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv("SHARDQ_HTTP_TOKEN", raising=False)


def test_by_default_the_console_wants_the_token_serve_made_on_loopback_too():
    with Service(shards=1, config=CONFIG) as s, s.connect() as q:
        url = s.http_url()
        jid = q.enqueue(b"precious", key="t")
        path = os.path.join(s.data_dir, "http-token")
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        with open(path) as f:
            token = f.read().strip()
        assert len(token) >= 32
        # Everything but the login page, its assets and loopback metrics is refused.
        for method, path_, body in (("GET", "/api/overview", None), ("GET", "/api/session", None),
                                    ("GET", f"/api/job?id={jid}", None), ("GET", "/api/dead-letters", None),
                                    ("POST", "/api/pause", {"queue": "default"}),
                                    ("POST", "/api/cancel", {"id": str(jid)})):
            status, _, data = request(url, path_, method, body)
            assert status == 401 and b"precious" not in data, (path_, status)
        assert request(url, "/")[0] == 303
        assert request(url, "/login")[0] == 200 and request(url, "/static/console.css")[0] == 200
        assert request(url, "/login?token=wrong-token-wrong-token")[1]["Location"] == "/login?failed=1"
        assert request(url, "/metrics")[0] == 200                                 # a local Prometheus
        assert request(url, "/metrics", headers={"Host": "evil.example"})[0] == 401  # DNS rebinding
        assert "paused" not in q.stats()["queues"]["default"] and q.job(jid)["state"] == "ready"
        # One step to open it: `shardq console` and the startup line print the login URL.
        r = cli("console", "--data-dir", s.data_dir)
        assert r.returncode == 0, r.stderr
        login = r.stdout.strip()
        assert login == f"{url}login?token={token}"
        assert f"console at {login}" in s.tail()
        cookie = logged_in(login)
        assert api(url, "/api/overview", headers=cookie)[0] == 200
        csrf = api(url, "/api/session", headers=cookie)[1]["csrf"]
        assert api(url, "/api/pause", {"queue": "default"}, {**cookie, "X-CSRF-Token": csrf})[0] == 200
        assert q.stats()["queues"]["default"]["paused"] is True
        assert api(url, "/api/overview", headers={"Authorization": f"Bearer {token}"})[0] == 200
        # The token outlives a restart: a bookmarked login and Prometheus' credentials stay valid.
        s.stop()
        s.start()
        url = s.http_url()
        assert api(url, "/api/overview", headers={"Authorization": f"Bearer {token}"})[0] == 200


def test_a_token_file_the_group_or_others_can_read_is_refused():
    tmp = short_tmpdir()
    data = os.path.join(tmp, "d")
    os.makedirs(data, mode=0o700)
    path = os.path.join(data, "http-token")
    with open(path, "w") as f:
        f.write("x" * 43 + "\n")
    os.chmod(path, 0o644)
    # any free port: not the repo config's 7781 (read from the working directory), which
    # another serve may hold, and serve binds it before it reads the token file
    r = cli("serve", "--data-dir", data, "--shards", "1", "--http-listen", "127.0.0.1:0")
    assert r.returncode == 5 and "refusing token file" in r.stderr and "chmod 600" in r.stderr, r.stderr[-2000:]
    assert "console at" not in r.stderr


def test_metrics_public_false_puts_metrics_behind_the_token_too():
    cfg = dict(CONFIG, http={"listen": "127.0.0.1:0", "metrics_public": False})
    with Service(shards=1, config=cfg) as s:
        url = s.http_url()
        with open(os.path.join(s.data_dir, "http-token")) as f:
            token = f.read().strip()
        assert request(url, "/metrics")[0] == 401
        status, _, data = request(url, "/metrics", headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and b"shardq_shard_up" in data


def test_auth_none_is_loopback_only_and_opens_everything_to_local_users():
    for listen in ("0.0.0.0:7781", "192.0.2.1:0", "[::]:0", "example.com:7781"):
        with pytest.raises(InvalidConfig, match="loopback"):
            parse({"http": {"listen": listen, "auth": "none"}})
    with pytest.raises(InvalidConfig, match="contradicts"):
        parse({"http": {"auth": "none", "token": "x" * 16}})
    with pytest.raises(InvalidConfig, match="http.auth"):
        parse({"http": {"auth": "off"}})
    assert parse({"http": {"listen": "[::1]:0", "auth": "none"}}).http.auth == "none"
    cfg = dict(CONFIG, http={"listen": "127.0.0.1:0", "auth": "none"})
    with Service(shards=1, config=cfg) as s:
        url = s.http_url()
        assert api(url, "/api/overview")[0] == 200
        assert not os.path.exists(os.path.join(s.data_dir, "http-token"))
        r = cli("console", "--data-dir", s.data_dir)
        assert r.returncode == 0 and r.stdout.strip() == url, r.stderr


def test_console_without_a_running_service_says_so():
    r = cli("console", "--data-dir", os.path.join(short_tmpdir(), "nothing"))
    assert r.returncode != 0 and re.search(r"no console is listening", r.stderr), r.stderr


# ---------------------------------------------------------------------------- where serve's token is
def files_under(path: str) -> dict[str, bytes]:
    """Every regular file below ``path`` (sockets and the like skipped), by path."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            p = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                with open(p, "rb") as f:
                    found[p] = f.read()
    return found


def console_with(data_dir: str, token: str | None = None, *args: str) -> subprocess.CompletedProcess:
    """``shardq console`` from a shell that has ``token`` as SHARDQ_HTTP_TOKEN (None: none)."""
    env = dict(ENV, **({"SHARDQ_HTTP_TOKEN": token} if token is not None else {}))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "console", "--data-dir", data_dir, *args],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
                          cwd=os.path.dirname(data_dir))  # no config/shardq.toml of the repo


def test_console_of_a_serve_whose_token_is_in_its_environment_says_to_set_it_never_a_stale_url(monkeypatch):
    """The user's case: SHARDQ_HTTP_TOKEN in serve's environment (/etc/shardq/env), `shardq
    console` from a shell without it. It printed the token of an http-token file left by an
    earlier start (login failed), or, with no such file, said to start serve, which ran."""
    given = "g" * 40
    s = Service(shards=1, config=CONFIG)
    token_file = os.path.join(s.data_dir, "http-token")
    monkeypatch.setenv("SHARDQ_HTTP_TOKEN", given)
    with s:  # a data dir whose serve never made a token file
        r = console_with(s.data_dir)
        assert r.returncode == 2, r.stderr
        [line] = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert line.startswith("error: UsageError: ") and "SHARDQ_HTTP_TOKEN" in line, line
        assert "its environment" in line and "start `shardq serve`" not in line, line
        # an earlier start without the variable made a token file; this start's token is another
        s.stop()
        monkeypatch.delenv("SHARDQ_HTTP_TOKEN")
        s.start()
        s.http_url()  # the listener made its token file before it published its address
        with open(token_file) as f:
            stale = f.read().strip()
        s.stop()
        monkeypatch.setenv("SHARDQ_HTTP_TOKEN", given)
        s.start()
        url = s.http_url()
        assert not os.path.exists(token_file)  # not left to be taken for serve's token
        # the secret it was given is written nowhere: not in the data dir (run/http.json
        # included), not in serve's log (a journal keeps it on disk), whose line says where it is
        assert not [p for p, data in files_under(s.data_dir).items() if given.encode() in data]
        assert given not in s.tail(1000) and f"console at {url} (log in with SHARDQ_HTTP_TOKEN" in s.tail()
        r = console_with(s.data_dir)
        assert r.returncode == 2 and "SHARDQ_HTTP_TOKEN" in r.stderr and stale not in r.stderr + r.stdout, r
        r = console_with(s.data_dir, given)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"{url}login?token={given}"
        assert api(url, "/api/overview", headers=logged_in(r.stdout.strip()))[0] == 200


def test_console_prints_the_token_serve_made_even_from_a_shell_with_another_in_its_environment():
    with Service(shards=1, config=CONFIG) as s:
        url = s.http_url()
        with open(os.path.join(s.data_dir, "http-token")) as f:
            made = f.read().strip()
        r = console_with(s.data_dir, "leftover-token-of-another-service")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"{url}login?token={made}"


def test_console_of_a_serve_whose_token_is_in_its_config_wants_that_config():
    configured = "c" * 32
    s = Service(shards=1, config=CONFIG)
    with s:
        s.http_url()  # the listener made its token file before it published its address
        s.stop()  # an earlier start made a token file
        assert os.path.exists(os.path.join(s.data_dir, "http-token"))
        s.config = dict(CONFIG, http={"listen": "127.0.0.1:0", "token": configured})
        s.start()
        url = s.http_url()
        assert not os.path.exists(os.path.join(s.data_dir, "http-token"))
        assert configured not in s.tail(1000) and f"console at {url} (log in with http.token" in s.tail()
        r = console_with(s.data_dir)  # no --config: this shell's command does not know the token
        assert r.returncode == 2 and "http.token" in r.stderr and "--config" in r.stderr, r.stderr
        r = console_with(s.data_dir, None, "--config", s.data_dir.rstrip("/") + ".toml")
        assert (r.returncode, r.stdout.strip()) == (0, f"{url}login?token={configured}"), r.stderr
