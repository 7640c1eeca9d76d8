"""The SQS listener of ``shardq serve``: one event loop, in a thread of its own (of serve, or
of a listener child), serving the asyncio HTTP listener
(:class:`shardq.service.aio_listener.AioListener`: the console's bounds on heads, bodies,
request deadlines, slow clients and connections, no thread per connection or request) with
a body limit that fits a 1 MiB batch however it is encoded.

Each request: SigV4 checked when keys are set (before the body is read, the Authorization
header must name our key id), decoded (:mod:`.protocol`), run (:mod:`.api`) as a coroutine
over the process's one :class:`~shardq.client.aio.AsyncQueue`, answered in its protocol's
form. Requests running at once share the queue's connections: the calls made in one loop
turn leave in one frame per shard, and a shard's replies are read as they arrive, with no
hand-off between threads. The queue connects to the shards as a part of serve (role
``service``), so a shard does not busy-poll after answering it; the loop polls instead
(:mod:`shardq.service.spin_selector`, ``[service] busy_poll_us``): for a shard's reply while
one request is answered alone, and for the next request after an answer that left none, so a
lone client's call wakes the loop from a sleep neither time. A long poll whose client has
gone is cancelled by the listener, and hands nothing out (:mod:`.messages`)."""
from __future__ import annotations

import asyncio
import email.utils
import gc
import itertools
import logging
import os
import secrets
import socket
from urllib.parse import urlsplit

from .. import limits
from ..busypoll import BUSY_POLL_US_DEFAULT, BusyPoll
from ..client import aio
from ..client.aio import AsyncQueue
from ..clock import Clock, SystemClock
from ..config import SqsApiConfig, split_listen
from ..errors import InvalidConfig, ShardqError, ShardUnavailable, SqsApiError
from ..service import http_head as head
from ..service.aio_listener import AioListener, AioRequest, AioResponse
from ..service.http_listener import bind, publish_address, unpublish_address
from ..loop_thread import LoopThread
from ..service.spin_selector import SpinSelector
from . import protocol
from .api import SqsApi
from .catalog import Catalog
from .faults import as_sqs, fault
from .sigv4 import Verifier

log = logging.getLogger("shardq.sqs_api")
ADDRESS_FILE = "sqs-api.json"  # in the data dir's run/ directory: where the listener is
START_S = 30.0   # the loop connects to the shards and serves within this, or start() fails
#: Listener processes that connect as a part of serve (role "service", which a shard does not
#: busy-poll after answering) while ``[sqs_api] processes`` is at most this: a shard holds 16
#: service connections (shard/acceptor.py), serve's own parts take a few, and a restarted
#: process's old one may still be open. More processes connect as clients (always admitted).
SERVICE_ROLE_PROCESSES_MAX = 8
STOP_GRACE_S = 2.0  # requests being answered at a stop get this long (then cancelled: a long poll hands nothing out)


#: Young objects (net allocations of containers) between two of a listener process's
#: collections: 10 times the interpreter's 700. Its requests leave garbage cycles (a batch
#: send's client futures), which at 700 set off a young collection every few dozen batch
#: requests and, every tenth, a middle one of up to ~1 ms that a lone call waits out.
GC_YOUNG = 7_000


def tune_gc() -> None:
    """In a process whose work is the listener's (``serve``, a listener child): what it
    built to start (modules, config, the shards' supervisor) out of the collector's view,
    so a full collection scans only what requests keep (about 36,000 objects were scanned
    before, 13 ms), and young collections ten times rarer. Cycles are still collected:
    nothing is frozen after this, unlike the shard's tuning (shard/process.py), whose
    survivors are jobs; a listener's survivors are requests in flight."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 10, 10)


def _split_target(target: str) -> tuple[str, str]:
    """(path, query) of a request target ("/" for none); ValueError for one that is no URL."""
    url = urlsplit(target)
    return url.path or "/", url.query


def bind_sqs_listen(listen: str) -> socket.socket:
    """The SQS listener's socket, bound and listening on ``listen`` (``host:port``);
    InvalidConfig names the key and how to turn it off when it cannot be had."""
    host, port = split_listen(listen, "sqs_api.listen")
    try:
        return bind((host, port), socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise InvalidConfig(f"sqs_api.listen {listen}: cannot listen: {e.strerror or e} (set "
                            f"[sqs_api] listen = \"\" to turn it off, or pick another port)") from None


class SqsService:
    """The listener; :meth:`start` serves on an event loop in a thread of its own,
    :meth:`stop` ends it."""

    def __init__(self, data_dir: str | os.PathLike[str], cfg: SqsApiConfig, *, clock: Clock | None = None,
                 busy_poll_us: int = BUSY_POLL_US_DEFAULT):
        self.cfg = cfg
        # the loop's waits ([service] busy_poll_us): for a lone request's reply; for the next request
        self.busy_reply, self.busy_next = BusyPoll(busy_poll_us), BusyPoll(busy_poll_us)
        self._responses = 0  # the listener's count of responses at the last wait
        self.host, self.port = split_listen(cfg.listen, "sqs_api.listen")
        self.clock = clock or SystemClock()
        self.data_dir = str(data_dir)
        self.catalog = Catalog(self.data_dir, self.clock)
        self.verifier = Verifier(cfg.access_key_id, cfg.secret_access_key, cfg.region) if cfg.access_key_id else None
        self.loop_thread: LoopThread | None = None  # the listener's loop (uvloop measured, not kept: performance.md)
        self.q: AsyncQueue | None = None          # made on the loop (an AsyncQueue is its loop's)
        self.api: SqsApi | None = None
        self.listener: AioListener | None = None
        self._address_file: str | None = None
        # request ids: unique per process start (random) and request (a counter), UUID-shaped
        # as AWS's; uuid4() read the kernel's random source once a request
        r = secrets.token_hex(10)
        self._request_prefix = f"{r[:8]}-{r[8:12]}-{r[12:16]}-{r[16:]}-"
        self._request_count = itertools.count()
        self._date: tuple[int, str] = (-1, "")  # (second, Date header): formatted once a second

    def start(self, run_dir: str | None = None, sock: socket.socket | None = None) -> SqsService:
        """Serve on ``sock`` (bound by :func:`bind_sqs_listen`, as ``serve`` does before any
        shard starts), or bind ``listen`` now. Returns once the listener serves."""
        if sock is None:
            sock = bind_sqs_listen(self.cfg.listen)
        # a lone client's waits are polled for (_poll_policy): ~0.1 ms less a SendMessage (performance.md)
        lt = self.loop_thread = LoopThread("shardq-sqs-api", SpinSelector(self._poll_policy))
        try:
            lt.call(self._start(sock), START_S)
        except BaseException as e:
            self.stop()
            sock.close()
            if isinstance(e, TimeoutError):
                raise ShardUnavailable(f"the SQS listener did not start within {START_S:.0f} s") from None
            raise
        if run_dir:
            self._address_file = publish_address(run_dir, ADDRESS_FILE, {
                "url": self.url, "pid": os.getpid(), "auth": "sigv4" if self.verifier else "open"})
        log.info("event=sqs-api-listening url=%s auth=%s", self.url, "sigv4" if self.verifier else "open-loopback")
        return self

    async def _start(self, sock: socket.socket) -> None:
        role = "service" if self.cfg.processes <= SERVICE_ROLE_PROCESSES_MAX else "client"
        self.q = await aio.connect(self.data_dir, retry_s=5.0, _role=role)
        self.api = SqsApi(self.q, self.catalog, self.cfg, self.clock)
        # one clock for the listener's deadlines, SigV4's window and the API's times
        self.listener = AioListener(sock, self._handle, self._wants_body, body_bytes_max=limits.SQS_API_BODY_BYTES_MAX,
                                    clock=self.clock)
        await self.listener.start()
        self.port = self.listener.address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def stop(self) -> None:
        """Stop accepting, give the requests being answered :data:`STOP_GRACE_S`, end the
        background work, close the shards' connections, end the loop's thread."""
        lt, self.loop_thread = self.loop_thread, None
        if lt is not None:
            lt.finish(self._stop(), STOP_GRACE_S + 15, log, "sqs-api-stop-failed")
        unpublish_address(self._address_file)
        self._address_file = None

    async def _stop(self) -> None:
        if self.listener is not None:
            await self.listener.close(STOP_GRACE_S)
            self.listener = None
        if self.api is not None:
            await self.api.close()
        if self.q is not None:
            await self.q.close()
        await asyncio.get_running_loop().shutdown_default_executor()  # catalog writes' and handshakes' threads

    def _poll_policy(self) -> BusyPoll | None:
        """How the loop's next wait polls: for a lone request's reply (one request being
        answered), or for the next request right after a response went out with none left to
        answer. A wait with several requests under way is load: it polls for neither, and
        counts as shared (:meth:`BusyPoll.note_shared`), so that while such waits are common
        (clients taking turns, each alone for a moment) neither polls, and the CPU stays with
        the shards and the clients."""
        listener = self.listener
        if listener is None:
            return None
        answering, responses = listener.answering, listener.responses
        if answering == 1:
            return self.busy_reply
        if answering == 0:
            if responses == self._responses:
                return None
            self._responses = responses
            return self.busy_next
        self.busy_reply.note_shared()
        self.busy_next.note_shared()
        return None

    # ------------------------------------------------------------------ requests
    def _wants_body(self, method: str, path: str, headers: head.Head) -> bool:
        """Read a body only for a POST that names our key id (when keys are set)."""
        if method != "POST":
            return False
        if self.verifier is None:
            return True
        auth = headers.get("Authorization") or ""
        return f"Credential={self.cfg.access_key_id}/" in auth

    async def _handle(self, req: AioRequest) -> AioResponse:
        headers = req.head  # parsed once, by the listener
        method, target, version = headers.method, headers.target, headers.version
        # the listener's keep_alive has read Connection already (close, or 1.0 without keep-alive)
        keep = req.keep_alive and version != "HTTP/1.0"
        request_id = f"{self._request_prefix}{next(self._request_count) & 0xFFFFFFFFFFFF:012x}"
        amz_target = headers.get("X-Amz-Target")
        is_json = bool(amz_target) or (headers.get("Content-Type") or "").startswith(protocol.JSON_TYPE)
        action = "?"
        try:
            try:
                path, query = ("/", "") if target == "/" else _split_target(target)  # "/": every JSON request
            except ValueError:
                raise fault("MalformedQueryString", "The request target is not a URL.") from None
            # a chunked body comes decoded (held to this listener's body limit); None: not read
            body = req.body
            if body is None:
                body = b""
                if headers.get("Transfer-Encoding"):  # a coding the listener does not decode
                    raise fault("InvalidParameterValue", "Transfer-Encoding other than chunked is not supported.")
                given = headers.get("Content-Length") or "0"
                length = int(given) if given.isdigit() else -1
                if method == "POST" and length:
                    if length < 0 or length > limits.SQS_API_BODY_BYTES_MAX:
                        raise fault("InvalidParameterValue", f"The request body is over "
                                                             f"{limits.SQS_API_BODY_BYTES_MAX} bytes.")
                    if self.verifier is not None:
                        raise fault("MissingAuthenticationToken" if not headers.get("Authorization")
                                    else "InvalidClientTokenId", "The security token included in the request is "
                                    "invalid." if headers.get("Authorization") else
                                    "Request is missing Authentication Token")
                    raise fault("InvalidParameterValue", "The request body was not read.")
            if method not in ("POST", "GET"):
                raise fault("InvalidAction", f"{method[:20]} is not supported: send POST (or GET, query protocol).")
            if self.verifier is not None:
                self.verifier.verify(method, path, query, headers, body, self.clock.now())
            if is_json and method == "POST":
                action, params = protocol.decode_json(amz_target, body)
            else:
                action, params = protocol.decode_query(body.decode("utf-8", "replace"), path, query)
            host = headers.get("Host") or f"{self.host}:{self.port}"
            api = self.api
            if api is None:  # (between start and stop only)
                raise ShardUnavailable("the SQS listener is stopping")
            result = await api.call(action, params, host)
        except SqsApiError as e:
            return self._error(e, is_json, request_id, keep)
        except ShardqError as e:
            return self._error(as_sqs(e), is_json, request_id, keep)
        except Exception:  # noqa: BLE001 - a bug answers InternalFailure, the listener lives on
            log.exception("event=sqs-api-error action=%s", action)
            return self._error(fault("InternalFailure", "The request processing has failed because of an "
                                                        "unknown error."), is_json, request_id, keep)
        if is_json:
            data, ctype = protocol.encode_json(result), protocol.JSON_TYPE
        else:
            data, ctype = protocol.encode_xml(action, result, request_id), "text/xml"
        return self._response(200, data, ctype, (("x-amzn-RequestId", request_id),), keep)

    def _error(self, e: SqsApiError, is_json: bool, request_id: str, keep: bool) -> AioResponse:
        if is_json:
            data, extra = protocol.json_error(e)
            return self._response(e.status, data, protocol.JSON_TYPE, (("x-amzn-RequestId", request_id), *extra), keep)
        return self._response(e.status, protocol.xml_error(e, request_id), "text/xml",
                              (("x-amzn-RequestId", request_id),), keep)

    def _response(self, status: int, data: bytes, ctype: str, headers: tuple[tuple[str, str], ...],
                  keep: bool) -> AioResponse:
        # Date: SDKs (Java, Go) correct their clock skew from it after a signature refusal
        now = int(self.clock.now())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True))
        return AioResponse(status, data, (("Content-Type", ctype), ("Date", self._date[1]), *headers), keep)
