"""The HTTP listener of ``shardq serve``: Prometheus metrics at ``/metrics``, the web console
at ``/`` and its JSON API under ``/api/``.

It runs in the supervisor process and talks to the shards like any client (one router), so
it is never on a shard's hot path: a scrape costs each shard one ``metrics_page`` request
per 8 MiB of its figures (one, below some 6,000 queues).
Security is in :mod:`.http_auth`: a token always (the configured one, else one made in
``<data dir>/http-token``) unless ``[http] auth = "none"`` on loopback, ``/metrics`` open on
loopback unless ``metrics_public = false``, CSRF checks on every state-changing request
(always a ``POST``). Connections are held by :mod:`.aio_listener` on one event loop, in a
thread of its own (:mod:`shardq.loop_thread`): bounded heads and bodies, an overall deadline per
request, a body read only for a request that passed authentication, no thread per
connection. The handlers stay synchronous (they call the threaded router, with short
timeouts): each whole request is answered in a thread of the loop's default executor
(``asyncio.to_thread``), which bounds their number, and returns the response whole.

Routes (described in full, with parameters, bodies and errors, by the OpenAPI document of
:mod:`.console.openapi`; the handler's route tables and it are held equal by a test)::

    GET  /openapi.json        that document (public: it holds no data)
    GET  /                    console page (login page first when a token is set)
    GET  /static/<file>       its assets (shipped in the package)
    GET  /login?token=T       logs in (sets the session cookie) and goes to /: the URL that
                              ``shardq console`` and serve's startup line print
    GET  /metrics             Prometheus text format
    GET  /api/session         {"csrf": ..., "auth": "open" | "token"}
    GET  /api/overview        queues, shards, totals
    GET  /api/dead-letters    ?queue=Q&limit=N&cursor=C
    GET  /api/job             ?id=JOB_ID
    GET  /api/workflow        ?id=WORKFLOW_ID
    POST /api/pause|resume    {"queue": Q}
    POST /api/cancel          {"id": JOB_ID}
    POST /api/redrive|purge   {"queue": Q, "ids": [JOB_ID, ...]}
    POST /api/limits          {"queue": Q, "values": {"concurrency": N, "rate": "50/s", ...} | null}
    GET|POST /login, POST /logout

Any other method gets 405 with ``Allow`` on a route (404 elsewhere), and a head of more
than 100 fields (what http.server refused by itself) 431, the same JSON error with the
security headers. A ``HEAD`` gets the head of what a ``GET`` of its path would get, without
the body (the listener drops it).
"""
from __future__ import annotations

import asyncio
import email.utils
import errno
import json
import logging
import os
import re
import socket
from http import HTTPStatus
from importlib import resources
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .. import limits
from ..client.router import Router
from ..config import HTTP_TOKEN_CHARS_MIN, HttpConfig, is_loopback, split_listen
from ..datadir import DataDir
from ..errors import (Closed, InvalidConfig, InvalidJob, LeaseLost, NotFound, QueueFull, ShardqError,
                      ShardUnavailable, Unsupported)
from .console import openapi
from .console.api import ConsoleApi
from .aio_listener import AioListener, AioRequest, AioResponse
from .http_auth import Auth
from .http_head import Head
from . import http_listener
from .http_listener import publish_address, unpublish_address
from .http_metrics import ShardqCollector
from ..loop_thread import LoopThread

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = logging.getLogger("shardq.http")

TOKEN_ENV = "SHARDQ_HTTP_TOKEN"
# Where the token comes from, as the address file records it (``token_from``; never the token):
TOKEN_FROM_CONFIG = "config"     # [http] token of serve's config
TOKEN_FROM_ENV = "env"           # SHARDQ_HTTP_TOKEN in serve's environment
TOKEN_FROM_FILE = "file"         # <data dir>/http-token, made by serve
LISTEN_ENV = "SHARDQ_HTTP_LISTEN"  # serve's listen address over [http] listen ("": off); --http-listen over both
LISTEN_FLAG = "--http-listen"
SCRAPE_TIMEOUT_S = 2.0           # a scrape waits at most this long for the shards
ADDRESS_FILE = "http.json"       # in the data dir's run/ directory: where the listener is
START_S = 10.0                   # the loop serves within this, or start() fails
STOP_GRACE_S = SCRAPE_TIMEOUT_S + 1.0  # a request being answered (its router calls' timeout) may finish
HEADERS_MAX = 100                # header fields in a head: 431 past it, as http.server refused
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                                "form-action 'self'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
# A ShardqError's status; any other is a 500. InvalidConfig is a bad limit value sent to
# POST /api/limits (its message names the key): the request's fault, 400. QueueFull (a new
# queue name past QUEUES_MAX) and Closed (the listener is stopping) are the service's state,
# not the request's fault: 503.
_ERROR_STATUS = ((NotFound, HTTPStatus.NOT_FOUND), (InvalidJob, HTTPStatus.BAD_REQUEST),
                 (InvalidConfig, HTTPStatus.BAD_REQUEST),
                 (LeaseLost, HTTPStatus.CONFLICT), (Unsupported, HTTPStatus.NOT_IMPLEMENTED),
                 (ShardUnavailable, HTTPStatus.SERVICE_UNAVAILABLE), (QueueFull, HTTPStatus.SERVICE_UNAVAILABLE),
                 (Closed, HTTPStatus.SERVICE_UNAVAILABLE))


# The token in a logged request line (GET /login?token=...): the debug access log must not hold it.
_TOKEN_IN_URL = re.compile(r"(token=)[^&\s]*")


def token_from(cfg: HttpConfig, env: Mapping[str, str] = os.environ) -> str | None:
    """Where :func:`resolve_token` takes the token from: :data:`TOKEN_FROM_CONFIG`,
    :data:`TOKEN_FROM_ENV` or :data:`TOKEN_FROM_FILE`; None for ``auth = "none"``. The address
    file records it (never the token), so that ``shardq console`` knows where to look."""
    if cfg.auth == "none":
        return None
    return TOKEN_FROM_CONFIG if cfg.token else TOKEN_FROM_ENV if env.get(TOKEN_ENV) else TOKEN_FROM_FILE


def resolve_token(cfg: HttpConfig, data_dir: str | None = None) -> str | None:
    """The token: the config's, else ``SHARDQ_HTTP_TOKEN``, else the one kept in
    ``<data_dir>/http-token`` (made there at first start); None only for ``auth = "none"``,
    or when there is none yet and no ``data_dir`` (``shardq serve`` calls this without one to
    refuse a bad setting before it starts any shard). InvalidConfig for a short token, for
    ``auth = "none"`` with a token or off loopback, and for a listener off loopback without a
    configured token (its users must be given it; a file on the server is no way to).

    With ``data_dir`` and a configured token (config or environment), a ``http-token`` file
    an earlier start made is removed: it is not the token now, and whoever read it (``shardq
    console``, a Prometheus ``credentials_file``) would fail to log in with it. The
    configured token is never written anywhere."""
    env = os.environ.get(TOKEN_ENV, "")
    host, _ = split_listen(cfg.listen)
    if cfg.auth == "none":
        if not is_loopback(host):
            raise InvalidConfig(f"http.auth = \"none\" is allowed on a loopback listen address only, "
                                f"not {cfg.listen!r}")
        if cfg.token or env:
            raise InvalidConfig(f"http.auth = \"none\" contradicts the token set in http.token or "
                                f"{TOKEN_ENV}: remove one of them")
        return None
    token = cfg.token or env
    if token and len(token) < HTTP_TOKEN_CHARS_MIN:
        raise InvalidConfig(f"{TOKEN_ENV}: the token must have at least {HTTP_TOKEN_CHARS_MIN} characters")
    if not token and not is_loopback(host):
        raise InvalidConfig(f"http.listen {cfg.listen!r} is not a loopback address: set http.token "
                            f"or {TOKEN_ENV} (anyone who can reach it could pause queues and cancel jobs)")
    if not token and data_dir is not None:
        token = DataDir(data_dir).http_token(create=True)
    elif token and data_dir is not None:
        _remove_made_token(DataDir(data_dir), token_from(cfg))
    return token or None


def _remove_made_token(dd: DataDir, source: str | None) -> None:
    """Remove the ``http-token`` file a start without a configured token made (see
    :func:`resolve_token`). One that cannot be removed is left, with a warning: ``shardq
    console`` goes by the address file's ``token_from`` and does not read it."""
    try:
        os.unlink(dd.http_token_path)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("event=http-token-stale path=%s token_from=%s error=%s: not serve's token; delete it",
                    dd.http_token_path, source, e.strerror)
        return
    log.info("event=http-token-removed path=%s token_from=%s", dd.http_token_path, source)


def bind_listen(listen: str) -> socket.socket:
    """The listener's socket, bound and listening on ``listen`` (``host:port``): ``serve``
    binds it before it starts any shard, so a port that is taken stops it at once, before
    it says it is ready. InvalidConfig names the port, the process that holds it (when
    psutil can tell: one of this user's) and how to move the listener or turn it off."""
    host, port = split_listen(listen)
    try:
        return http_listener.bind((host, port), socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        held = _holder(port) if e.errno == errno.EADDRINUSE else None
        raise InvalidConfig(
            f"http.listen {listen}: cannot listen on port {port}: {e.strerror or e}"
            + (f" (held by {held})" if held else "")
            + f"; move the listener with {LISTEN_FLAG} HOST:PORT ({LISTEN_FLAG} 127.0.0.1:0 takes any free "
            f"port), or turn it off with {LISTEN_FLAG} \"\" (or {LISTEN_ENV}, or [http] listen in the config)"
        ) from None


def _holder(port: int) -> str | None:
    """Which process listens on TCP ``port``, in words; None if psutil cannot tell (another
    user's process, a platform that does not say)."""
    import psutil
    try:
        for c in psutil.net_connections("inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                p = psutil.Process(c.pid)
                return f"pid {c.pid}: {' '.join(' '.join(p.cmdline()).split())[:160] or p.name()}"
    except (psutil.Error, OSError):
        pass
    return None


class HttpService:
    """The listener; :meth:`start` binds and serves on an event loop in a daemon thread,
    :meth:`stop` ends it."""

    def __init__(self, data_dir: str, cfg: HttpConfig, supervisor: Supervisor | None = None, *,
                 token: str | None = None, scrape_timeout_s: float = SCRAPE_TIMEOUT_S):
        host, port = split_listen(cfg.listen)
        self.token = token if token is not None else resolve_token(cfg, data_dir)
        # None for a token the caller gave (not serve's): shardq console then looks everywhere
        self.token_from = token_from(cfg) if token is None else None
        if self.token is None and (cfg.auth != "none" or not is_loopback(host)):
            raise InvalidConfig(f"http.listen {cfg.listen!r}: a token is required (auth = \"none\" is "
                                f"the only way without one, and on loopback only)")
        self.host, self.port = host, port
        self.supervisor = supervisor
        self.data_dir = str(data_dir)
        # Short retries: a page or a scrape should report a down shard, not wait for it.
        self.router = Router(data_dir, retry_s=0.5, request_timeout_s=scrape_timeout_s,
                             _role="service")  # sees a shard full of clients
        # /metrics without the token: only where only this machine can connect (Prometheus
        # on the same host), and only if the operator has not asked for the token there too.
        self.auth = Auth(self.token, metrics_public=cfg.metrics_public and is_loopback(host))
        self.api = ConsoleApi(self.router, supervisor, scrape_timeout_s)
        self.openapi = json.dumps(openapi.document()).encode()  # GET /openapi.json: the same bytes each time
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ShardqCollector(self.router, supervisor, scrape_timeout_s))
        self.listener: AioListener | None = None
        self._loop: LoopThread | None = None
        self._address_file: str | None = None

    def start(self, run_dir: str | None = None, sock: socket.socket | None = None) -> HttpService:
        """Serve on ``sock`` (from :func:`bind_listen`), else on a socket bound now; returns
        once the listener serves."""
        try:
            sock = sock if sock is not None else bind_listen(f"[{self.host}]:{self.port}" if ":" in self.host
                                                              else f"{self.host}:{self.port}")
        except InvalidConfig:
            self.router.close()
            raise
        self.listener = AioListener(sock, self._handle, self._wants_body, answer_after_eof=True)
        self.port = self.listener.address[1]
        self._loop = LoopThread("shardq-http")
        try:
            self._loop.call(self.listener.start(), START_S)
        except BaseException:
            self.stop()
            sock.close()
            raise
        if run_dir:
            self._address_file = publish_address(run_dir, ADDRESS_FILE, {
                "url": self.url, "auth": "token" if self.token else "open", "pid": os.getpid(),
                **({"token_from": self.token_from} if self.token and self.token_from else {})})
        log.info("event=http-listening url=%s auth=%s", self.url, "token" if self.token else "open-loopback")
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def login_url(self) -> str:
        """The URL that opens the console logged in (it holds the token: print it only to
        the user who may have it)."""
        return login_url(self.url, self.token)

    async def _handle(self, req: AioRequest) -> AioResponse:
        """Answer one whole request in a thread of the loop's default executor: the handler
        blocks on the router. A client that goes away cancels the wait, not the thread (its
        router calls end within their timeout; the response is dropped)."""
        return await asyncio.to_thread(_Handler(req, self).run)

    def _wants_body(self, method: str, path: str, headers: Head) -> bool:
        """Whether a request's body is worth reading, from its head: a POST to log in or out,
        or one that is authenticated. Any other body is never read (the handler refuses the
        request first)."""
        if method != "POST" or not self.auth.host_ok(headers):
            return False
        return path in ("/login", "/logout") or self.auth.identify(headers) is not None

    def stop(self) -> None:
        """Stop accepting, give the requests being answered :data:`STOP_GRACE_S`, wait for
        the handlers' threads, end the loop's thread, close the router."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.finish(self._stop(), STOP_GRACE_S + 15, log, "http-stop-failed")
        self.listener = None
        unpublish_address(self._address_file)
        self._address_file = None
        self.router.close()

    async def _stop(self) -> None:
        if self.listener is not None:
            await self.listener.close(STOP_GRACE_S)
        await asyncio.get_running_loop().shutdown_default_executor()  # the handlers' threads


def login_url(url: str, token: str | None) -> str:
    """``url`` (the listener's, ending in ``/``) with the login that sets the session cookie;
    ``url`` itself without a token."""
    return f"{url}login?token={quote(token, safe='')}" if token else url


class _Handler:
    """One whole request (its body too, when the client may send one: the listener has read
    it), answered by :meth:`run` as one :class:`.AioResponse` (status, headers, body), never
    written to a socket here. Synchronous: it runs in a thread of the loop's executor."""

    def __init__(self, req: AioRequest, app: HttpService):
        self.req, self.app = req, app
        self.headers: Head = req.head
        self.command = req.head.method
        # as http.server: "//x" is a path, not a network location ("GET //evil.com/")
        target = req.head.target
        self.path = "/" + target.lstrip("/") if target.startswith("//") else target
        self.response: AioResponse | None = None

    def run(self) -> AioResponse:
        """The response; its ``keep_alive`` False closes the connection after it."""
        if self.headers.field_count() > HEADERS_MAX:
            self._error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
        else:
            getattr(self, "do_" + self.command)()
        resp = self.response
        if resp is None:  # every route answers: a handler that did not is a bug, not a hang
            log.error("event=http-no-response method=%s", self.command)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "InternalError", "message": "no response"})
            resp = self.response
            if resp is None:
                raise RuntimeError("the handler made no response")
        # access log at debug level (the token in a logged target is masked)
        log.debug('%s "%s %s %s" %d %d', self.req.peer[0] if self.req.peer else "-", self.command,
                  _TOKEN_IN_URL.sub(r"\1...", self.path), self.headers.version, resp.status, len(resp.body))
        return resp

    # ------------------------------------------------------------------ dispatch
    # The routes, as tables: routes() must equal the routes of the document served at
    # /openapi.json (tests/service/test_console_fuzz.py holds them equal). "/static/" is a prefix.
    _PUBLIC_GET = {"/login": "_login_page", "/openapi.json": "_openapi"}
    _GET = {"/": "_page", "/metrics": "_metrics", "/api/session": "_session", "/api/overview": "_overview",
            "/api/dead-letters": "_dead_letters", "/api/job": "_job", "/api/workflow": "_workflow"}
    _PUBLIC_POST = {"/login": "_login", "/logout": "_logout"}

    @classmethod
    def routes(cls) -> set[tuple[str, str]]:
        """Every (method, path) this handler answers."""
        return ({("GET", "/static/{name}")} | {("GET", p) for p in (*cls._PUBLIC_GET, *cls._GET)}
                | {("POST", p) for p in cls._PUBLIC_POST} | {("POST", f"/api/{a}") for a in ConsoleApi.ACTIONS})

    def _target(self) -> tuple[str, dict[str, str]] | None:
        """The request's path and query (the last value of each name); None once a 400 is
        sent for a target that is no URL (``//[x``: urlsplit refuses it)."""
        try:
            url = urlsplit(self.path)
        except ValueError:
            self._json(HTTPStatus.BAD_REQUEST, {"error": "InvalidJob", "message": "the request target is not a URL"})
            return None
        # keep_blank_values: "?queue=" names the queue "" (refused), it does not mean the default
        return url.path, {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        target = self._target()
        if target is None:
            return None
        path, query = target
        if not self.app.auth.host_ok(self.headers):
            return self._json(HTTPStatus.FORBIDDEN, {"error": "Forbidden", "message": "Host is not loopback"})
        if path.startswith("/static/"):
            return self._static(path[len("/static/"):])
        public = self._PUBLIC_GET.get(path)
        if public is not None:
            getattr(self, public)(query)
            return None
        how = self.app.auth.identify(self.headers)
        if how is None and path == "/metrics" and self.app.auth.metrics_open(self.headers):
            how = "metrics"  # for this path only: the /metrics route answers it
        if how is None:
            if path == "/":
                return self._redirect("/login")
            return self._json(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized",
                                                        "message": "a token is required (bearer or login)"})
        route = self._GET.get(path)
        if route is None:
            return self._not_allowed()
        getattr(self, route)(query)
        return None

    def _login_page(self, query: dict[str, str]) -> None:
        if "token" in query:  # the printed URL: log in, then drop the token from the address bar
            if self.app.auth.login_ok(query["token"]):
                return self._redirect("/", cookie=self.app.auth.session_cookie())
            return self._redirect("/login?failed=1")
        return self._static("login.html")

    def _openapi(self, query: dict[str, str]) -> None:
        self._send(HTTPStatus.OK, self.app.openapi, "application/json")

    def _page(self, query: dict[str, str]) -> None:
        self._static("index.html")

    def _metrics(self, query: dict[str, str]) -> None:
        self._send(HTTPStatus.OK, generate_latest(self.app.registry), CONTENT_TYPE_LATEST)

    def _session(self, query: dict[str, str]) -> None:
        self._json(HTTPStatus.OK, {"csrf": self.app.auth.csrf, "auth": "token" if self.app.token else "open",
                                   "data_dir": self.app.data_dir})

    def _overview(self, query: dict[str, str]) -> None:
        self._call(self.app.api.overview)

    def _dead_letters(self, query: dict[str, str]) -> None:
        self._call(self.app.api.dead_letters, query.get("queue", "default"), query.get("limit", 50),
                   query.get("cursor"))

    def _job(self, query: dict[str, str]) -> None:
        self._call(self.app.api.job, query.get("id"))

    def _workflow(self, query: dict[str, str]) -> None:
        self._call(self.app.api.workflow, query.get("id"))

    def do_POST(self) -> None:  # noqa: N802 - http.server's handler naming
        target = self._target()
        if target is None:
            return None
        path = target[0]
        auth = self.app.auth
        if not auth.host_ok(self.headers):
            return self._json(HTTPStatus.FORBIDDEN, {"error": "Forbidden", "message": "Host is not loopback"})
        public = self._PUBLIC_POST.get(path)
        if public is not None:
            body = self._body()
            if body is None:
                return None
            getattr(self, public)(body)
            return None
        # Authentication first, the body after: a client that may not act cannot make the
        # listener read (or wait for) a megabyte.
        how = auth.identify(self.headers)
        if how is None:
            return self._json(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized", "message": "a token is required"})
        if not auth.csrf_ok(self.headers, how):
            return self._json(HTTPStatus.FORBIDDEN, {"error": "Forbidden",
                                                     "message": "missing or wrong X-CSRF-Token, or a foreign Origin"})
        action = path[len("/api/"):] if path.startswith("/api/") else ""
        if action not in ConsoleApi.ACTIONS:
            return self._not_allowed()
        if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
            return self._json(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "UnsupportedMediaType",
                                                                   "message": "send application/json"})
        body = self._body()
        if body is None:
            return None
        try:
            data = json.loads(body or b"{}")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return self._json(HTTPStatus.BAD_REQUEST, {"error": "InvalidJob", "message": "body is not JSON"})
        if not isinstance(data, dict):
            return self._json(HTTPStatus.BAD_REQUEST, {"error": "InvalidJob", "message": "send a JSON object"})
        log.info("event=console-action action=%s by=%s args=%s", action, how, json.dumps(data)[:200])
        return self._call(getattr(self.app.api, action), data)

    def _not_allowed(self) -> None:
        """A method the path has no route for: 405 with ``Allow`` on a route of other methods,
        404 elsewhere (for methods other than GET and POST too, instead of http.server's 501
        page, whose HTML comes without the security headers)."""
        target = self._target()
        if target is None:
            return None
        path = target[0]
        allowed = sorted({m for m, p in self.routes()
                          if p == path or (p == "/static/{name}" and path.startswith("/static/"))})
        if not allowed:
            return self._json(HTTPStatus.NOT_FOUND, {"error": "NotFound", "message": f"no page {path!r:.80}"})
        self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "MethodNotAllowed",
                                                   "message": f"{self.command} is not allowed here"},
                   headers=(("Allow", ", ".join(allowed)),))

    def __getattr__(self, name: str) -> Callable[[], None]:
        # http.server looks up do_<METHOD> for the request's method: every method but GET
        # and POST, known (HEAD, PUT, QUERY...) or not, is answered by _not_allowed.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _error(self, code: int, message: str) -> None:
        """What http.server refused by itself (a head of too many fields): the API's JSON
        error with the security headers, and the connection closed."""
        status = HTTPStatus(code)
        self._json(code, {"error": status.phrase.replace(" ", "").replace("-", ""), "message": message[:200]},
                   keep_alive=False)

    def _login(self, body: bytes) -> None:
        token = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[-1]
        if self.app.auth.login_ok(token):
            return self._redirect("/", cookie=self.app.auth.session_cookie())
        return self._redirect("/login?failed=1")

    def _logout(self, body: bytes) -> None:
        self._redirect("/login", cookie=self.app.auth.logout_cookie())

    # ------------------------------------------------------------------ helpers
    def _body(self) -> bytes | None:
        """The body the listener read, or None once a refusal is sent (413 for one over
        ``limits.HTTP_BODY_BYTES_MAX``; 411 for a transfer coding the listener does not
        read: one other than ``chunked``, or beside a Content-Length). A chunked body
        comes decoded, held to the same limit by the listener."""
        if self.headers.get("Transfer-Encoding"):
            if self.req.body is None:
                self._json(HTTPStatus.LENGTH_REQUIRED, {
                    "error": "LengthRequired",
                    "message": "send the body with a Content-Length, or as Transfer-Encoding: chunked alone"})
                return None
            return self.req.body
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= limits.HTTP_BODY_BYTES_MAX:
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       {"error": "InvalidJob", "message": f"body over {limits.HTTP_BODY_BYTES_MAX} bytes"})
            return None
        if length and self.req.body is None:  # cannot happen: the listener reads it for these
            self._json(HTTPStatus.BAD_REQUEST, {"error": "InvalidJob", "message": "body not read"})
            return None
        return self.req.body if length else b""

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            result = fn(*args)
        except ShardqError as e:
            status = next((s for cls, s in _ERROR_STATUS if isinstance(e, cls)), HTTPStatus.INTERNAL_SERVER_ERROR)
            return self._json(status, {"error": type(e).__name__, "message": str(e)[:500]})
        return self._json(HTTPStatus.OK, result)

    def _static(self, name: str) -> None:
        if "/" in name or name.startswith(".") or os.path.splitext(name)[1] not in STATIC_TYPES:
            return self._json(HTTPStatus.NOT_FOUND, {"error": "NotFound", "message": "no such asset"})
        try:
            data = resources.files("shardq.service.console").joinpath("static", name).read_bytes()
        except (OSError, ValueError):  # not there; a name too long for the file system; a NUL in it
            return self._json(HTTPStatus.NOT_FOUND, {"error": "NotFound", "message": "no such asset"})
        self._send(HTTPStatus.OK, data, STATIC_TYPES[os.path.splitext(name)[1]])

    def _redirect(self, where: str, cookie: str | None = None) -> None:
        headers = (("Location", where),) + ((("Set-Cookie", cookie),) if cookie else ())
        self.response = AioResponse(HTTPStatus.SEE_OTHER, b"", (*_server_headers(), *headers, *SECURITY_HEADERS))

    def _json(self, status: int, obj: Any, headers: tuple[tuple[str, str], ...] = (), *,
              keep_alive: bool = True) -> None:
        self._send(status, json.dumps(obj, default=str).encode(), "application/json", headers, keep_alive)

    def _send(self, status: int, data: bytes, ctype: str, headers: tuple[tuple[str, str], ...] = (),
              keep_alive: bool = True) -> None:
        # Content-Length and Connection are the listener's; so is dropping a HEAD's body
        self.response = AioResponse(status, data, (*_server_headers(), ("Content-Type", ctype),
                                                   *SECURITY_HEADERS, *headers), keep_alive)


def _server_headers() -> tuple[tuple[str, str], ...]:
    """The fields http.server put first in every response."""
    return (("Server", "shardq"), ("Date", email.utils.formatdate(usegmt=True)))
