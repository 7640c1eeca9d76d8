"""Connections of the HTTP listener: bounded threads, bounded bytes, overall deadlines.

An HTTP server that gives each connection a thread before it has a request lets anyone who
can connect hold threads: send half a request, or one byte now and then. This one does not.

* **One receiver thread** accepts every connection and reads each request, non-blocking,
  until it is whole: the head (request line and headers) up to ``HTTP_HEAD_BYTES_MAX``
  (431 past it), then the body, but only when ``wants_body`` (the authentication check)
  says so and it is at most ``HTTP_BODY_BYTES_MAX``; a refused body is never read into
  memory. A chunked body (``Transfer-Encoding: chunked``) is decoded as it arrives and
  held to the same limit (413 past it, 400 if malformed); any other transfer coding, or
  one beside a ``Content-Length``, is not read (the handler answers 411). Head and body
  must arrive within ``HTTP_REQUEST_S_MAX`` of the connection (or of the previous response
  on a kept-alive one): a deadline for the whole request, which more bytes do not extend
  (408, closed).
* **``HTTP_WORKERS`` threads** answer whole requests only: they never wait for a client to
  send. A client that does not take its response within ``HTTP_WRITE_S_MAX`` is cut off.
* **At most ``HTTP_CONNECTIONS_MAX`` connections** are held. A new one past the cap closes the
  connection whose request has waited longest (a client that sends its request at once is
  never the one), or, when every held one is being answered, is itself refused with 503.
* Each head is parsed once (:mod:`.http_head`), by the receiver; the handler gets it with
  the request. The body rules, the refusals and the chunk decoder are :mod:`.http_rules`'s,
  shared with the event loop's listener (:mod:`.aio_listener`).
* After a refused request (its body not read), the listener stops sending and drops what
  the client still sends for at most ``HTTP_LINGER_S_MAX``, so that the client reads the
  refusal instead of a reset.

So the listener's threads are ``1 + HTTP_WORKERS`` whatever the clients do, and its memory is
bounded by the cap times the head and body limits.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from .. import limits
from ..clock import Clock, SystemClock
from .http_head import HEAD_END, Head
from .http_head import parse as parse_head
from .http_rules import CHUNKED, CONTINUE, ChunkedBody, body_of
from .http_rules import refusal as _refusal

log = logging.getLogger("shardq.http")

_HEAD, _BODY, _LINGER = "head", "body", "linger"


def bind(address: tuple[Any, ...], family: int) -> socket.socket:
    """A TCP socket bound to ``address`` and listening (connections wait in its backlog
    until a :class:`Listener` serves it); OSError (EADDRINUSE...) with nothing left open."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def publish_address(run_dir: str, name: str, info: dict[str, object]) -> str:
    """Write ``info`` as JSON to ``run_dir/name`` whole (a temp file renamed over it), so a
    reader never sees half of it; the path, for :func:`unpublish_address`."""
    path = os.path.join(run_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    return path


def unpublish_address(path: str | None) -> None:
    """Remove a file :func:`publish_address` wrote (gone already: nothing to do)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass
class Request:
    """One whole request for a worker: ``data`` holds its head, and its body when
    ``body_ready``. ``keep_alive`` False: the connection is closed after the response
    whatever the handler says (its body was refused and is still on the wire)."""
    sock: socket.socket
    peer: tuple[Any, ...]
    data: bytes
    body_ready: bool
    keep_alive: bool
    rest: bytes = b""  # bytes after this request (pipelined): the start of the next one
    body: bytes | None = None  # a chunked body, decoded (``data`` then holds the head only)
    head: Head | None = None  # the parsed head; None: not an HTTP/1.x request head


@dataclass
class _Conn:
    sock: socket.socket
    peer: tuple[Any, ...]
    deadline: float
    phase: str = _HEAD
    buf: bytearray = field(default_factory=bytearray)
    scanned: int = 0    # bytes of buf already searched for the end of the head
    head_len: int = 0
    body_len: int = 0
    chunked: ChunkedBody | None = None
    head: Head | None = None


class Listener:
    """Serves ``address`` with ``handle(request) -> keep the connection open`` on the workers.
    ``wants_body(method, path, head)`` decides, from the head alone, whether a body is read."""

    def __init__(self, address: tuple[Any, ...], family: int, handle: Callable[[Request], bool],
                 wants_body: Callable[[str, str, Head], bool], *,
                 clock: Clock | None = None, workers: int = limits.HTTP_WORKERS,
                 body_bytes_max: int = limits.HTTP_BODY_BYTES_MAX, sock: socket.socket | None = None):
        self.handle, self.wants_body = handle, wants_body
        self.workers, self.body_bytes_max = workers, body_bytes_max
        self.clock = clock or SystemClock()
        self.sock = sock if sock is not None else bind(address, family)  # sock: bound by the caller already
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full pipe means a wake-up is pending already
        self._held: dict[socket.socket, _Conn] = {}  # in the receiver; insertion order = waiting longest first
        self._answering = 0                           # handed to workers, not back yet
        self._work: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        # (socket or None: closed, peer, bytes of its next request, kept alive)
        self._back: queue.SimpleQueue[tuple[socket.socket | None, tuple[Any, ...], bytes, bool]] = \
            queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._threads = [threading.Thread(target=self._receive, name="shardq-http", daemon=True)]
        self._threads += [threading.Thread(target=self._answer, name=f"shardq-http-{i}", daemon=True)
                          for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop accepting, close every held connection, end the threads (a worker finishes
        the response it is writing first, for at most ``HTTP_WRITE_S_MAX``)."""
        self._stopping.set()
        self._wake()
        for _ in range(self.workers):
            self._work.put(None)
        for t in self._threads:
            t.join(limits.HTTP_WRITE_S_MAX + 1)
        while not self._back.empty():  # handed back after the receiver ended
            sock = self._back.get_nowait()[0]
            if sock is not None:
                sock.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # a wake-up already pending (buffer full), or the receiver has ended
            pass

    # ------------------------------------------------------------------ receiver
    def _receive(self) -> None:
        try:
            while not self._stopping.is_set():
                now = self.clock.monotonic()
                timeout = min((c.deadline for c in self._held.values()), default=now + 1.0) - now
                for key, _ in self._sel.select(max(0.0, min(timeout, 1.0))):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_back()
                    elif (c := self._held.get(cast(socket.socket, key.fileobj))) is not None:  # the rest: sockets
                        self._readable(c)  # (one closed earlier in this batch, by the cap, is skipped)
                now = self.clock.monotonic()
                for c in [c for c in self._held.values() if c.deadline <= now]:
                    if c.phase != _LINGER and c.buf:
                        self._send_quietly(c.sock, _refusal(408, "Request Timeout"))
                    self._close(c)
        finally:
            for c in list(self._held.values()):
                self._close(c)
            self._sel.close()
            self.sock.close()
            self._wake_r.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: free one the cap's way, or leave it in the backlog
                log.warning("event=http-accept-failed error=%s", e)
                if not self._held:
                    return
                self._close(next(iter(self._held.values())))
                continue
            sock.setblocking(False)
            if len(self._held) + self._answering >= limits.HTTP_CONNECTIONS_MAX:
                waiting = next(iter(self._held.values()), None)
                if waiting is None:
                    self._send_quietly(sock, _refusal(503, "Service Unavailable"))
                    sock.close()
                    continue
                log.debug("event=http-connection-dropped peer=%s reason=cap", waiting.peer)
                self._close(waiting)
            self._hold(_Conn(sock, peer, self.clock.monotonic() + limits.HTTP_REQUEST_S_MAX))

    def _hold(self, c: _Conn) -> None:
        self._held[c.sock] = c
        self._sel.register(c.sock, selectors.EVENT_READ, None)
        if c.buf:  # a pipelined request may already be whole
            self._progress(c)

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                sock, peer, rest, keep = self._back.get_nowait()
            except queue.Empty:
                return
            self._answering -= 1
            if sock is None:
                continue
            sock.setblocking(False)
            now = self.clock.monotonic()
            if keep:
                self._hold(_Conn(sock, peer, now + limits.HTTP_REQUEST_S_MAX, buf=bytearray(rest)))
                continue
            try:  # the refusal is sent: tell the client, then drop what it still sends
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                sock.close()
                continue
            self._hold(_Conn(sock, peer, now + limits.HTTP_LINGER_S_MAX, phase=_LINGER))

    def _readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._close(c)
        if c.phase == _LINGER:
            return
        c.buf += data
        self._progress(c)

    def _progress(self, c: _Conn) -> None:
        if c.phase == _HEAD:
            # Search only the last 3 old bytes and the new ones: a drip costs O(bytes).
            m = HEAD_END.search(c.buf, max(0, c.scanned - 3))
            c.scanned = len(c.buf)
            if m is None or m.end() > limits.HTTP_HEAD_BYTES_MAX:
                if m is not None or len(c.buf) > limits.HTTP_HEAD_BYTES_MAX:
                    self._send_quietly(c.sock, _refusal(431, "Request Header Fields Too Large"))
                    self._linger(c)
                return
            c.head_len = m.end()
            c.head, length, wanted, expects = self._body_of(bytes(c.buf[:c.head_len]))
            if not wanted:
                return self._dispatch(c, body_ready=False, keep_alive=length == 0)
            if expects:  # the client waits for this before it sends the body (curl, over 1 KiB)
                self._send_quietly(c.sock, CONTINUE)
            c.phase = _BODY
            if length == CHUNKED:
                c.chunked = ChunkedBody(self.body_bytes_max)
            else:
                c.body_len = length
        if c.phase == _BODY and c.chunked is not None:
            ch = c.chunked
            del c.buf[c.head_len:ch.feed(c.buf, c.head_len)]  # decoded: hold the body once
            if ch.status:
                self._send_quietly(c.sock, _refusal(ch.status, ch.reason))
                return self._linger(c)
            if ch.done:
                self._dispatch(c, body_ready=True, keep_alive=True)
        elif c.phase == _BODY and len(c.buf) >= c.head_len + c.body_len:
            self._dispatch(c, body_ready=True, keep_alive=True)

    def _body_of(self, data: bytes) -> tuple[Head | None, int, bool, bool]:
        """(the parsed head, then :func:`.http_rules.body_of`'s length, whether to read the
        body and whether the client expects 100 Continue). A head that does not parse gets
        no body read and no keep-alive: the handler answers 400."""
        head = parse_head(data)
        if head is None:
            return None, -1, False, False
        return (head, *body_of(head, self.body_bytes_max, self.wants_body))

    def _dispatch(self, c: _Conn, body_ready: bool, keep_alive: bool) -> None:
        end = c.head_len + (c.body_len if body_ready else 0)  # a chunked body is out of buf already
        self._sel.unregister(c.sock)
        del self._held[c.sock]
        self._answering += 1
        self._work.put(Request(c.sock, c.peer, bytes(c.buf[:end]), body_ready, keep_alive,
                               bytes(c.buf[end:]) if keep_alive else b"",
                               bytes(c.chunked.body) if c.chunked is not None and body_ready else None, c.head))

    def _linger(self, c: _Conn) -> None:
        try:
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._close(c)
        c.phase, c.buf = _LINGER, bytearray()
        c.deadline = min(c.deadline, self.clock.monotonic() + limits.HTTP_LINGER_S_MAX)

    def _close(self, c: _Conn) -> None:
        self._held.pop(c.sock, None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    @staticmethod
    def _send_quietly(sock: socket.socket, data: bytes) -> None:
        """A short refusal, without waiting: it fits an empty send buffer, and a client
        that is not reading loses it."""
        try:
            sock.send(data)
        except OSError:
            pass

    # ------------------------------------------------------------------ workers
    def _answer(self) -> None:
        while (req := self._work.get()) is not None:
            self._answer_one(req)

    def _answer_one(self, req: Request) -> None:
        """Answer ``req``; its connection goes back to the receiver, or is closed."""
        # sendall's timeout bounds a whole write (Python 3.5+), not each chunk
        req.sock.settimeout(limits.HTTP_WRITE_S_MAX)
        keep: bool | None
        try:
            keep = self.handle(req) and req.keep_alive
        except OSError as e:  # the client went away, or did not take its response in time
            log.debug("event=http-request-failed peer=%s error=%r", req.peer, e)
            req.sock.close()
            keep = None
        except Exception:  # noqa: BLE001 - a handler bug must not cost a worker thread
            log.exception("event=http-handler-error peer=%s", req.peer)
            req.sock.close()
            keep = None
        if self._stopping.is_set():
            if keep is not None:
                req.sock.close()
            return
        # Back to the receiver, which keeps the count of connections being answered;
        # None: closed here.
        self._back.put((req.sock if keep is not None else None, req.peer, req.rest, bool(keep)))
        self._wake()
