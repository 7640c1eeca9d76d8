"""An HTTP/1.1 listener on one asyncio event loop (the SQS API's and the console's): no thread
per connection or request, bounded bytes, overall deadlines.

Each connection is an :class:`asyncio.Protocol` that reads its request until it is whole, then
hands it to the handler (started in the same loop turn, a task from its first wait on:
:mod:`.eager`), and writes the response the handler returns with one
``transport.write``. A request whose head and body arrive in one read is parsed once and handed
on from that read.

* **The head** (request line and headers) is at most ``HTTP_HEAD_BYTES_MAX`` (431 past it) and
  parsed with :func:`.http_head.parse`, the project's own parser: h11 was measured at 42 us a
  request and response on this project's VM, against ~140 us for a whole SQS request on an event
  loop, too dear on the hot path. A head that does not parse gets 400.
* **The body** follows :func:`.http_rules.body_of`: it is read only
  when ``wants_body`` (the authentication check) says so and it is at most ``body_bytes_max``; a
  refused body is never read into memory (the handler gets ``body=None`` and ``keep_alive``
  False, and answers: 413, 411, 401...). A chunked body is decoded as it arrives
  (:class:`.http_rules.ChunkedBody`) under the same limit (413 past it, 400 if malformed).
  ``Expect: 100-continue`` is answered with 100 Continue when the body is wanted.
* **Deadlines**: head and body must arrive within ``HTTP_REQUEST_S_MAX`` of the connection (or of
  the previous response, taken whole): a deadline for the whole request that more bytes do not
  extend (408, closed). A response not taken within ``HTTP_WRITE_S_MAX`` cuts the connection.
  One loop timer per connection, moved only when it fires early (a deadline that moved later
  re-arms it then), so a request costs no timer-heap change.
* **At most ``HTTP_CONNECTIONS_MAX`` connections** are held. A new one past the cap closes the
  connection whose request has waited longest (one being answered never is), or, when every held
  one is being answered, is itself refused with 503.
* **In order**: pipelined requests on a connection are answered one at a time, in order; what
  arrives meanwhile waits in the connection's buffer (reading pauses past one whole request's
  worth of bytes).
* **The client's departure cancels its request**: when a connection is lost (EOF or reset) while
  its handler runs, the handler's task is cancelled (a long poll whose client has gone must hand
  nothing out). The connection is kept reading while its request is answered for that reason.
  With ``answer_after_eof`` (the console's: its requests are short and change state only
  when asked to, so a client that half-closes after its request, as scripts do, is still
  answered) an EOF while a request is answered is not a departure: the response is written
  (``Connection: close``), then the connection closed; requests pipelined behind it are not
  answered.
* After a response that does not keep the connection (a refused body is still on the wire,
  HTTP/1.0 without keep-alive, ``Connection: close``, the handler's choice), the listener stops
  sending and drops what the client still sends for at most ``HTTP_LINGER_S_MAX``, so that the
  client reads the response instead of a reset.

So its memory is bounded by the cap times the head and body limits, and it starts no thread.
"""
from __future__ import annotations

import asyncio
import http
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from .. import limits
from ..clock import Clock, SystemClock
from . import eager
from .http_head import Head
from .http_head import parse as parse_head
from .http_rules import CHUNKED, CONTINUE, ChunkedBody, body_of, refusal

log = logging.getLogger("shardq.http")

# A connection's phases: reading a request's head or body; its request being answered (the
# handler runs); its response being taken; dropping what it still sends after a refusal.
_HEAD, _BODY, _ANSWER, _WRITE, _LINGER, _CLOSED = range(6)


@dataclass(slots=True)
class AioRequest:
    """One whole request. ``body``: the whole body (chunked: decoded), ``b""`` for a request that
    has none, None when it was not read (``wants_body`` said no, too large, a transfer coding not
    decoded). ``keep_alive`` False: the listener closes the connection after this response
    whatever the handler says (a refused body is still on the wire, HTTP/1.0 without
    keep-alive, ``Connection: close``)."""
    head: Head
    body: bytes | None
    peer: tuple[Any, ...]
    keep_alive: bool


@dataclass(slots=True)
class AioResponse:
    """The handler's answer. ``Content-Length`` and ``Connection`` are the listener's to write;
    ``keep_alive`` False closes the connection after it. To a ``HEAD`` the listener sends the
    head only, with the body's ``Content-Length``."""
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    keep_alive: bool = True


Handler = Callable[[AioRequest], Awaitable[AioResponse]]

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}


def _head_end(buf: bytes | bytearray, start: int) -> int:
    """Where the first blank line at or after ``start`` ends, as ``HEAD_END.search(buf,
    start).end()`` finds it; -1 for none. Two ``find``s of its two forms after a line's
    ``\\n`` (the earlier wins; a CR before that ``\\n`` does not move the end): the regular
    expression, with no literal to look for first, took 3.3 us a usual SQS head (timeit)."""
    lf = buf.find(b"\n\n", start)
    crlf = buf.find(b"\n\r\n", start)
    if lf < 0:
        return crlf + 3 if crlf >= 0 else -1
    return lf + 2 if crlf < 0 or lf < crlf else crlf + 3


class AioListener:
    """Serves ``sock`` (bound and listening: :func:`.http_listener.bind`) on the running loop
    with ``await handle(request) -> response``. ``wants_body(method, path, head)`` decides, from
    the head alone, whether a body is read. The listener owns ``sock`` from :meth:`start`.
    Deadlines are read from ``clock`` (``monotonic()``); the loop's timers only wake the listener
    to check them, so a clock that has not reached a deadline re-arms its timer. ``answer_after_eof``:
    a client's EOF (not a reset) while its request is answered does not cancel it (module docstring)."""

    def __init__(self, sock: socket.socket, handle: Handler, wants_body: Callable[[str, str, Head], bool], *,
                 body_bytes_max: int = limits.HTTP_BODY_BYTES_MAX, clock: Clock | None = None,
                 answer_after_eof: bool = False) -> None:
        self.sock, self.handle, self.wants_body = sock, handle, wants_body
        self.answer_after_eof = answer_after_eof
        self.body_bytes_max = body_bytes_max
        self.clock = clock or SystemClock()
        self._address: tuple[Any, ...] = sock.getsockname()
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[_Conn, None] = {}     # every held connection
        self._waiting: dict[_Conn, None] = {}   # those not being answered; insertion order = waiting longest first
        self._closing = False
        self._emptied: asyncio.Event | None = None  # set by the last connection to go, while closing
        self.responses = 0                          # written so far (a response's write counts it)

    @property
    def address(self) -> tuple[Any, ...]:
        return self._address

    @property
    def connections(self) -> int:
        """Connections held now."""
        return len(self._conns)

    @property
    def answering(self) -> int:
        """Connections whose request is being answered (or its response written) now: every
        held one that is not waiting for a request (nor lingering)."""
        return len(self._conns) - len(self._waiting)

    async def start(self) -> None:
        """Serving on the running loop when it returns."""
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        self._server = await loop.create_server(lambda: _Conn(self, loop), sock=self.sock,
                                                backlog=64, start_serving=True)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting and close every connection: one waiting for a request at once, one
        being answered once its response is written, for at most ``grace_s``; then the handlers
        still running are cancelled and every connection left is cut."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for c in list(self._waiting):
            c.close()
        if self._conns:
            self._emptied = asyncio.Event()
            try:  # (not wait_for: in 3.11 it loses a cancel that comes as the wait ends)
                async with asyncio.timeout(grace_s):
                    await self._emptied.wait()
            except TimeoutError:
                pass
        tasks = [c.task for c in self._conns if c.task is not None]
        for c in list(self._conns):
            c.abort()
        if tasks:
            await asyncio.wait(tasks)
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------------ the connections' bookkeeping
    def _accepted(self, c: _Conn) -> bool:
        """Hold ``c``, closing the connection that has waited longest past the cap; False: every
        held one is being answered, ``c`` is refused (the caller sends 503)."""
        if self._closing:
            return False
        if len(self._conns) >= limits.HTTP_CONNECTIONS_MAX:
            oldest = next(iter(self._waiting), None)
            if oldest is None:
                return False
            log.debug("event=http-connection-dropped peer=%s reason=cap", oldest.peer)
            oldest.abort()
        self._conns[c] = None
        self._waiting[c] = None
        return True

    def _gone(self, c: _Conn) -> None:
        self._conns.pop(c, None)
        self._waiting.pop(c, None)
        if not self._conns and self._emptied is not None:
            self._emptied.set()


class _Conn(asyncio.Protocol):
    """One connection: the phases of the module's docstring, one timer."""

    transport: asyncio.Transport  # set by connection_made, before anything else is called

    __slots__ = ("lst", "loop", "transport", "peer", "phase", "buf", "scanned", "head", "body_len", "chunked",
                 "keep", "deadline", "timer", "task", "paused_writing", "paused_reading", "eof")

    def __init__(self, lst: AioListener, loop: asyncio.AbstractEventLoop):
        self.lst, self.loop = lst, loop
        self.peer: tuple[Any, ...] = ()
        self.phase = _HEAD
        self.buf: bytes | bytearray = b""   # bytes of the request being read (its head dropped once parsed)
        self.scanned = 0                    # bytes of buf already searched for the end of the head
        self.head: Head | None = None
        self.body_len = 0
        self.chunked: ChunkedBody | None = None
        self.keep = True                    # the request being answered may keep the connection
        self.deadline = 0.0                 # of the phase: clock.monotonic() seconds
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.paused_writing = False
        self.paused_reading = False
        self.eof = False                    # the client half-closed while answered (answer_after_eof)

    # ------------------------------------------------------------------ asyncio's calls
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # create_server's: a stream
        self.peer = transport.get_extra_info("peername") or ()
        if not self.lst._accepted(self):
            self.phase = _CLOSED
            transport.write(refusal(503, "Service Unavailable"))
            transport.close()
            return
        # pause_writing whenever the kernel did not take a write whole: the write deadline starts
        transport.set_write_buffer_limits(high=0)
        self._deadline(self.lst.clock.monotonic() + limits.HTTP_REQUEST_S_MAX)

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        if phase == _HEAD or phase == _BODY:
            self._append(data)
            self._progress()
        elif phase == _ANSWER or phase == _WRITE:
            if self.keep:  # the next request, pipelined: kept for when this one is answered
                self._append(data)
                if len(self.buf) > limits.HTTP_HEAD_BYTES_MAX + self.lst.body_bytes_max:
                    self.paused_reading = True
                    self.transport.pause_reading()
            # else: a refused body, still arriving: dropped, never held
        # _LINGER, _CLOSED: dropped

    def eof_received(self) -> bool:
        if self.lst.answer_after_eof and (self.phase == _ANSWER or self.phase == _WRITE):
            self.eof = True  # answered, then closed: nothing more can come
            return True
        return False  # the transport closes; connection_lost cancels a running handler

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase = _CLOSED
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client has gone: its request must hand nothing out
        self.lst._gone(self)

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        if self.phase == _WRITE:
            self._written()

    # ------------------------------------------------------------------ reading a request
    def _append(self, data: bytes) -> None:
        if not self.buf:
            self.buf = data  # the usual case, a request in one read: no copy
        else:
            if type(self.buf) is bytes:
                self.buf = bytearray(self.buf)
            self.buf += data

    def _progress(self) -> None:
        """Read what ``buf`` holds of the request; hand it on once whole, or refuse it."""
        buf = self.buf
        if self.phase == _HEAD:
            # Search only the last 3 old bytes and the new ones: a drip costs O(bytes).
            head_len = _head_end(buf, max(0, self.scanned - 3))
            self.scanned = len(buf)
            if head_len < 0 or head_len > limits.HTTP_HEAD_BYTES_MAX:
                if head_len >= 0 or len(buf) > limits.HTTP_HEAD_BYTES_MAX:
                    self._refuse(431, "Request Header Fields Too Large")
                return
            head = parse_head(buf[:head_len] if head_len < len(buf) else buf)
            buf = self.buf = buf[head_len:]
            self.scanned = 0
            if head is None:
                return self._refuse(400, "Bad Request")
            length, wanted, expects = body_of(head, self.lst.body_bytes_max, self.lst.wants_body)
            if not wanted:  # no body, or one the handler refuses: left on the wire
                return self._dispatch(head, b"" if length == 0 else None, length == 0)
            self.head = head
            if expects:  # the client waits for this before it sends the body (curl, over 1 KiB)
                self.transport.write(CONTINUE)
            self.phase = _BODY
            if length == CHUNKED:
                self.chunked = ChunkedBody(self.lst.body_bytes_max)
            else:
                self.body_len = length
        head = self.head  # parsed: the _BODY phase
        if head is None:
            return
        ch = self.chunked
        if ch is not None:
            pos = ch.feed(buf, 0)
            self.buf = buf = buf[pos:]  # decoded: the body is held once
            if ch.status:
                return self._refuse(ch.status, ch.reason)
            if ch.done:
                self.chunked = None
                self._dispatch(head, bytes(ch.body), True)
        elif len(buf) >= self.body_len:
            n = self.body_len
            body = buf if n == len(buf) and type(buf) is bytes else bytes(memoryview(buf)[:n])
            self.buf = buf[n:]
            self._dispatch(head, body, True)

    def _dispatch(self, head: Head, body: bytes | None, keep: bool) -> None:
        """Hand the whole request to the handler: started at once, a task of its own from its
        first wait on (:mod:`.eager`)."""
        if head.version == "HTTP/1.0":
            keep = keep and (head.get("Connection") or "").lower() == "keep-alive"
        elif (head.get("Connection") or "").lower() == "close":
            keep = False
        self.phase, self.keep, self.head = _ANSWER, keep, None
        self.lst._waiting.pop(self, None)
        if not keep:
            self.buf = b""  # what follows is a refused body, or nothing to answer
        answer = self._answer(AioRequest(head, body, self.peer, keep))
        if self.buf:  # requests pipelined behind it: a task, so that answering them never nests
            self.task = self.loop.create_task(answer)
        else:  # its first step in this loop turn, a task only if it waits (eager.py)
            self.task, _ = eager.start(self.loop, answer)

    async def _answer(self, req: AioRequest) -> None:
        try:
            resp = await self.lst.handle(req)
        except Exception:  # noqa: BLE001 - a handler bug costs its connection, not the listener
            log.exception("event=http-handler-error peer=%s", self.peer)
            self.abort()
            return
        finally:
            self.task = None
        if self.phase == _CLOSED:
            return
        keep = req.keep_alive and resp.keep_alive and not self.lst._closing and not self.eof
        status = _STATUS_LINES.get(resp.status) or f"HTTP/1.1 {resp.status} Unknown\r\n".encode()
        fields = "".join([f"{k}: {v}\r\n" for k, v in resp.headers])
        connection = ("keep-alive" if keep else "close")
        self.keep = keep
        # a HEAD's response is the head alone; its Content-Length still says the body's (RFC 9110 9.3.2)
        self.transport.write(b"%s%sContent-Length: %d\r\nConnection: %s\r\n\r\n%s" % (
            status, fields.encode("latin-1"), len(resp.body), connection.encode(),
            b"" if req.head.method == "HEAD" else resp.body))
        self.lst.responses += 1
        if self.paused_writing:  # the kernel did not take it whole: the client has this long
            self.phase = _WRITE
            self._deadline(self.lst.clock.monotonic() + limits.HTTP_WRITE_S_MAX)
        else:
            self._written()

    def _written(self) -> None:
        """The response is taken: the next request, under a deadline that starts now; or, not
        kept, linger."""
        if self.eof:  # the client sends nothing more: nothing to linger for
            return self.close()
        if not self.keep:
            return self._linger()
        if self.lst._closing:
            return self.close()
        self.phase = _HEAD
        self.lst._waiting[self] = None
        self._deadline(self.lst.clock.monotonic() + limits.HTTP_REQUEST_S_MAX, later=True)
        if self.paused_reading:
            self.paused_reading = False
            self.transport.resume_reading()
        if self.buf:  # a pipelined request may be whole already
            self._progress()

    # ------------------------------------------------------------------ refusals and the end
    def _refuse(self, status: int, reason: str) -> None:
        """Refuse the request being read, and linger; within its own deadline still."""
        self.transport.write(refusal(status, reason))
        self._linger(self.deadline)

    def _linger(self, until: float | None = None) -> None:
        """Stop sending (once what is written is out) and drop what the client still sends,
        for at most ``HTTP_LINGER_S_MAX`` (and not past ``until``)."""
        if self.lst._closing:
            return self.close()
        self.phase, self.buf, self.head, self.chunked = _LINGER, b"", None, None
        self.lst._waiting[self] = None  # waiting for nothing: the first to go past the cap
        self.transport.write_eof()
        at = self.lst.clock.monotonic() + limits.HTTP_LINGER_S_MAX
        self._deadline(at if until is None else min(at, until))

    def close(self) -> None:
        """Close once what is written is out."""
        if self.phase != _CLOSED:
            self.phase = _CLOSED
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection now, and count it out at once (the cap's count must not wait
        for the loop's next turn)."""
        self.phase = _CLOSED
        self.transport.abort()
        self.lst._gone(self)

    # ------------------------------------------------------------------ the one timer
    def _deadline(self, at: float, later: bool = False) -> None:
        """The phase's deadline is ``at``. The timer is moved only when it would fire too late;
        ``later``: ``at`` is no earlier than the one before, so the armed timer stays and,
        firing early, re-arms itself (a kept-alive request changes no timer)."""
        self.deadline = at
        if self.timer is not None and later:
            return
        if self.timer is not None:
            self.timer.cancel()
        self._arm(at)

    def _arm(self, at: float) -> None:
        self.timer = self.loop.call_at(self.loop.time() + max(0.0, at - self.lst.clock.monotonic()), self._fire)

    def _fire(self) -> None:
        self.timer = None
        phase = self.phase
        if phase == _CLOSED or phase == _ANSWER:
            return  # an answer has no deadline of its own; _written arms the next
        if self.lst.clock.monotonic() < self.deadline:
            return self._arm(self.deadline)
        if phase == _WRITE:
            log.debug("event=http-write-timeout peer=%s", self.peer)
        elif phase != _LINGER and (self.buf or phase == _BODY):
            self.transport.write(refusal(408, "Request Timeout"))  # what the kernel takes goes out
        # cut, not closed: close() would wait for a client that does not read to take what is written
        self.abort()
