"""The event loop's HTTP listener (shardq/service/aio_listener.py: the SQS API's and the console's)
in process, on real sockets on 127.0.0.1, with a small echo handler: every limit at its maximum
and one past it, deadlines with short constants, the connection cap at its real value, pipelined
requests in order, a handler cancelled when its client goes, HTTP/1.0 keep-alive decided by the
listener, a HEAD answered with the head alone."""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from shardq import limits
from shardq.clock import Clock, FakeClock
from shardq.service.aio_listener import AioListener, AioRequest, AioResponse
from shardq.service.http_head import Head
from shardq.service import aio_listener
from shardq.service.http_listener import bind

from support.service import wait_until


def wants_body(method: str, path: str, head: Head) -> bool:
    return path != "/unwanted"  # the authentication check's place


def answer(head: Head, body: bytes | None, keep: bool) -> AioResponse:
    """The echo handler's answer."""
    if body is None:  # not read: answered as the console's handler answers
        status = 411 if head.get("Transfer-Encoding") else 413 if head.method == "POST" else 401
        return AioResponse(status, b"refused\n", keep_alive=False)
    if head.target.startswith("/big"):
        return AioResponse(200, b"b" * int(head.target[4:]))
    text = f"{head.method} {head.target} {len(body)} {'keep' if keep else 'close'}"
    return AioResponse(200, text.encode(), (("Content-Type", "text/plain"),))


class Served:
    """An AioListener on a loop of its own thread, serving the echo handler; the test talks to it
    with blocking sockets. A request for ``/hold...`` is answered once the test releases it."""

    seen: list[tuple[str, bytes | None, bool]]   # (target, body, keep_alive), as the handler starts
    running: set[str]                            # targets whose handler runs now

    def __init__(self, clock: Clock | None = None, answer_after_eof: bool = False):
        self.seen, self.running = [], set()
        self.in_task: list[tuple[str, bool]] = []  # (target, whether its handler started in a task)
        self.cancelled: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.lst = AioListener(bind(("127.0.0.1", 0), socket.AF_INET), self.echo, wants_body, clock=clock,
                               answer_after_eof=answer_after_eof)
        self.call(self.lst.start())
        self.address = self.lst.address

    def call(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def connections(self) -> int:
        return self.lst.connections

    def answering(self) -> int:
        """Connections whose request is being answered."""
        return self.lst.answering

    def release(self, target: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self._gate(target).set())

    def _gate(self, target: str) -> asyncio.Event:
        return self.gates.setdefault(target, asyncio.Event())

    async def echo(self, req: AioRequest) -> AioResponse:
        target = req.head.target
        self.seen.append((target, req.body, req.keep_alive))
        self.in_task.append((target, asyncio.current_task() is not None))
        self.running.add(target)
        try:
            if target.startswith("/hold"):
                await self._gate(target).wait()
        except asyncio.CancelledError:
            self.cancelled.append(target)
            raise
        finally:
            self.running.discard(target)
        return answer(req.head, req.body, req.keep_alive)

    def close(self, grace_s: float = 1.0) -> None:
        self.call(self.lst.close(grace_s))
        self.stop_loop()

    def stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture()
def served():
    s = Served()
    yield s
    s.close()


def connect(served: Served) -> socket.socket:
    return socket.create_connection(served.address, timeout=10)


def get(target: str, extra: str = "", version: str = "HTTP/1.1") -> bytes:
    return f"GET {target} {version}\r\nHost: x\r\n{extra}\r\n".encode()


def post(target: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes."""
    out = bytearray()
    while chunk := s.recv(1 << 20):
        out += chunk
    return bytes(out)


def exchange(served: Served, data: bytes) -> tuple[int, bytes]:
    """Send ``data``, read to the close: (the first status, everything)."""
    with connect(served) as s:
        s.sendall(data)
        out = to_close(s)
    return int(out.split(b" ", 2)[1]), out


_left: dict[int, bytes] = {}


def responses(s: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """The next ``n`` responses on ``s``: (status, body)."""
    buf, out = _left.pop(s.fileno(), b""), []
    while len(out) < n:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            size = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            if len(rest) >= size:
                out.append((int(head.split(b" ", 2)[1]), rest[:size]))
                buf = rest[size:]
                continue
        chunk = s.recv(1 << 20)
        assert chunk, f"closed after {out}"
        buf += chunk
    _left[s.fileno()] = buf
    return out


def head_of(size: int) -> bytes:
    """A GET head of exactly ``size`` bytes, blank line included."""
    fixed = get("/padded", "Connection: close\r\nX-Pad: \r\n")
    return fixed.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (size - len(fixed)))


def chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\nX-Trailer: yes\r\n\r\n"


def post_chunked(data: bytes, coding: str = "chunked", extra: str = "") -> bytes:
    return (f"POST /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: {coding}\r\n{extra}\r\n"
            ).encode() + data


# ---------------------------------------------------------------------------------- bounds


def test_head_at_its_maximum_passes_and_one_byte_more_is_431(served):
    status, out = exchange(served, head_of(limits.HTTP_HEAD_BYTES_MAX))
    assert status == 200 and out.endswith(b"GET /padded 0 close")
    assert exchange(served, head_of(limits.HTTP_HEAD_BYTES_MAX + 1))[0] == 431
    # a head that never ends is refused once it passes the limit, not buffered on
    assert exchange(served, b"GET / HTTP/1.1\r\nX-Pad: " + b"p" * (limits.HTTP_HEAD_BYTES_MAX + 1))[0] == 431
    assert exchange(served, b"NOT HTTP\r\n\r\n")[0] == 400
    assert [t for t, _, _ in served.seen] == ["/padded"]


def test_body_at_its_maximum_is_read_and_one_byte_more_is_not_awaited(served):
    body = bytes(range(256)) * (limits.HTTP_BODY_BYTES_MAX // 256)
    status, out = exchange(served, post("/b", body, "Connection: close\r\n"))
    assert status == 200 and out.endswith(b"POST /b %d close" % limits.HTTP_BODY_BYTES_MAX)
    assert served.seen[-1][1] == body
    # one byte more: the head alone, no body sent; answered at once, the body never awaited
    with connect(served) as s:
        s.sendall(f"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: {limits.HTTP_BODY_BYTES_MAX + 1}\r\n\r\n"
                  .encode())
        out = to_close(s)
    assert out.startswith(b"HTTP/1.1 413 ") and out.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in out
    assert served.seen[-1] == ("/b", None, False)
    # sent anyway: dropped as it comes (not held), and the client reads the answer, not a reset
    status, out = exchange(served, post("/b", body + b"x"))
    assert status == 413 and out.count(b"HTTP/1.1 ") == 1 and served.seen[-1] == ("/b", None, False)
    # not wanted (authentication): not read either, whatever its size
    status, _ = exchange(served, post("/unwanted", b"12345"))
    assert status == 413 and served.seen[-1] == ("/unwanted", None, False)


def test_a_chunked_body_at_its_maximum_is_read_and_one_byte_more_is_413(served):
    body = bytes(range(256)) * (limits.HTTP_BODY_BYTES_MAX // 256)
    status, out = exchange(served, post_chunked(chunked(body, 65536 - 7)))
    assert status == 200 and served.seen[-1] == ("/c", body, False)
    n = len(served.seen)
    assert exchange(served, post_chunked(chunked(body + b"x", 65536 - 7)))[0] == 413
    # refused from the chunk size alone, before the bytes past the limit are read
    assert exchange(served, post_chunked(b"%x\r\n" % (limits.HTTP_BODY_BYTES_MAX + 1)))[0] == 413
    assert exchange(served, post_chunked(b"zz\r\n{}\r\n0\r\n\r\n"))[0] == 400
    assert exchange(served, post_chunked(b"2\r\n{}XX0\r\n\r\n"))[0] == 400
    assert len(served.seen) == n  # the listener refused these; the handler never saw them
    # a coding not decoded, or one beside a Content-Length (smuggling): not read, the handler's 411
    data = chunked(b"abc", 2)
    assert exchange(served, post_chunked(data, coding="gzip, chunked"))[0] == 411
    assert exchange(served, post_chunked(data, extra=f"Content-Length: {len(data)}\r\n"))[0] == 411
    assert served.seen[-1] == ("/c", None, False)


def test_a_request_has_an_overall_deadline_that_more_bytes_do_not_extend(served, monkeypatch):
    monkeypatch.setattr(limits, "HTTP_REQUEST_S_MAX", 0.6)
    with connect(served) as s:
        start = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\n")
        s.settimeout(0.1)
        out = b""
        while time.monotonic() - start < 5:
            try:
                s.sendall(b"X: y\r\n")  # a header line every 0.1 s: never a silent connection
                out = s.recv(65536)
                break
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed with our drip unread
                break
        took = time.monotonic() - start
    assert out == b"" or out.startswith(b"HTTP/1.1 408 ")
    assert 0.6 - 0.05 <= took <= 0.6 + 1.5, took
    # a kept-alive connection's deadline starts at the previous response; an idle one closes silently
    with connect(served) as s:
        s.sendall(get("/a"))
        assert responses(s, 1) == [(200, b"GET /a 0 keep")]
        start = time.monotonic()
        assert to_close(s) == b""
        assert 0.6 - 0.05 <= time.monotonic() - start <= 0.6 + 1.5
    wait_until(lambda: served.connections() == 0, 5, what="connections closed")


def test_deadlines_are_read_from_the_injected_clock(monkeypatch):
    monkeypatch.setattr(limits, "HTTP_REQUEST_S_MAX", 0.2)
    clock = FakeClock()
    served = Served(clock)
    try:
        with connect(served) as s:
            s.sendall(b"GET / HTTP/1.1\r\n")
            s.settimeout(0.6)  # three times the deadline in real time: the clock has not moved
            with pytest.raises(TimeoutError):
                s.recv(100)
            clock.advance(0.2)
            s.settimeout(5)
            assert s.recv(100).startswith(b"HTTP/1.1 408 ")
    finally:
        served.close()


def test_each_head_is_parsed_once_however_its_bytes_arrive(served, monkeypatch):
    calls = []

    def counted(data):
        calls.append(bytes(data[:4]))
        return parse(data)
    parse = aio_listener.parse_head
    monkeypatch.setattr(aio_listener, "parse_head", counted)
    with connect(served) as s:
        s.sendall(get("/a") + post("/b", b"xyz") + get("/c"))  # in one read, most likely
        assert [b for _, b in responses(s, 3)] == [b"GET /a 0 keep", b"POST /b 3 keep", b"GET /c 0 keep"]
        for byte in post("/d", b"12"):  # a drip
            s.sendall(bytes([byte]))
        assert responses(s, 1) == [(200, b"POST /d 2 keep")]
    assert calls == [b"GET ", b"POST", b"GET ", b"POST"]


def test_a_response_not_taken_in_time_cuts_the_connection(served, monkeypatch):
    monkeypatch.setattr(limits, "HTTP_WRITE_S_MAX", 0.3)
    size = 64 * 1024 * 1024  # far more than both sockets' buffers hold
    with connect(served) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(get(f"/big{size}"))
        wait_until(lambda: served.seen, 5, what="the request answered")
        wait_until(lambda: served.connections() == 0, 5, what="the connection cut")
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    assert 0 < got < size


def test_the_connection_cap_closes_the_longest_waiting_and_refuses_503_when_all_are_answered(served):
    cap = limits.HTTP_CONNECTIONS_MAX
    threads = threading.active_count()
    half = []
    try:
        for i in range(cap):
            if i % 32 == 0:  # within the listen backlog: a connect past it is retried a second later
                wait_until(lambda: served.connections() == i, 10, what="connections accepted")
            s = connect(served)
            s.sendall(b"GET / HTTP/1.1\r\nHost: ")  # and nothing more
            half.append(s)
        wait_until(lambda: served.connections() == cap, 10, what="every connection held")
        # one past the cap: the longest waiting goes, the new one is answered
        assert exchange(served, get("/new", "Connection: close\r\n"))[0] == 200
        half[0].settimeout(5)
        assert half[0].recv(100) == b""
        assert served.connections() <= cap
        for s in half:
            s.close()
        half.clear()
        wait_until(lambda: served.connections() == 0, 10, what="the half-sent connections let go")
        for i in range(cap):
            if i % 32 == 0:
                wait_until(lambda: served.answering() == i, 10, what="requests being answered")
            s = connect(served)
            s.sendall(get(f"/hold{i}"))
            half.append(s)
        wait_until(lambda: served.answering() == cap, 10, what="every request being answered")
        assert threading.active_count() == threads  # no thread per connection or request
        # every held connection is being answered: the new one is refused as it comes (a client
        # that sends before it reads may see a reset instead: its request is never read)
        with connect(served) as s:
            out = to_close(s)
        assert out.startswith(b"HTTP/1.1 503 ") and out.endswith(b"Service Unavailable\n")
        for i in range(cap):
            served.release(f"/hold{i}")
        for i, s in enumerate(half):
            assert responses(s, 1) == [(200, f"GET /hold{i} 0 keep".encode())]
    finally:
        for s in half:
            s.close()


# ---------------------------------------------------------------------------------- HTTP/1.1


def test_pipelined_requests_are_answered_in_order_one_at_a_time(served):
    with connect(served) as s:
        s.sendall(get("/hold-first") + post("/second", b"12345") + get("/third"))
        wait_until(lambda: "/hold-first" in served.running, 5, what="the first request answered")
        assert [t for t, _, _ in served.seen] == ["/hold-first"]  # the next waits for its turn
        served.release("/hold-first")
        assert responses(s, 3) == [(200, b"GET /hold-first 0 keep"), (200, b"POST /second 5 keep"),
                                   (200, b"GET /third 0 keep")]
        s.sendall(get("/fourth"))  # and the connection is kept for more
        assert responses(s, 1) == [(200, b"GET /fourth 0 keep")]
        s.sendall(get("/last", "Connection: close\r\n"))
        out = to_close(s)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in out and out.endswith(b"close")


def test_a_lone_request_is_answered_from_its_read_and_one_pipelined_behind_another_by_a_task(served):
    """A handler starts in the loop turn that read its request (service/eager.py: a task only
    once it waits), unless more requests wait behind it: then as a task, so that a run of
    pipelined requests answered at once never nests."""
    with connect(served) as s:
        s.sendall(get("/lone"))
        assert responses(s, 1) == [(200, b"GET /lone 0 keep")]
        s.sendall(get("/hold-held"))  # started at once, then waits: cancellable, as a task's
        wait_until(lambda: "/hold-held" in served.running, 5, what="the held request answered")
        served.release("/hold-held")
        assert responses(s, 1) == [(200, b"GET /hold-held 0 keep")]
        s.sendall(get("/ahead") + get("/behind"))
        assert responses(s, 2) == [(200, b"GET /ahead 0 keep"), (200, b"GET /behind 0 keep")]
    # (/behind starts in /ahead's task's last step, which read it: at once, within that task)
    assert served.in_task == [("/lone", False), ("/hold-held", False), ("/ahead", True), ("/behind", True)]


def test_the_requests_being_answered_and_the_responses_written_are_counted(served):
    """What the SQS listener's loop decides its busy-polling by (shardq/sqs_api/server.py)."""
    with connect(served) as s, connect(served) as idle:
        idle.sendall(b"GET /half")  # a request still being read is not being answered
        s.sendall(get("/hold-a"))
        wait_until(lambda: "/hold-a" in served.running, 5, what="the request answered")
        assert (served.lst.answering, served.lst.responses, served.connections()) == (1, 0, 2)
        served.release("/hold-a")
        assert responses(s, 1) == [(200, b"GET /hold-a 0 keep")]
        wait_until(lambda: served.lst.answering == 0, 5, what="the response written")
        assert served.lst.responses == 1


def test_http_1_0_closes_unless_it_asks_for_keep_alive(served):
    status, out = exchange(served, get("/old", version="HTTP/1.0") + get("/never", version="HTTP/1.0"))
    assert status == 200 and out.count(b"HTTP/1.1 ") == 1 and out.endswith(b"GET /old 0 close")
    with connect(served) as s:
        s.sendall(get("/a", "Connection: keep-alive\r\n", "HTTP/1.0"))
        assert responses(s, 1) == [(200, b"GET /a 0 keep")]
        s.sendall(get("/b", "Connection: keep-alive\r\n", "HTTP/1.0"))
        assert responses(s, 1) == [(200, b"GET /b 0 keep")]


def test_expect_100_continue_is_answered_when_the_body_is_wanted(served):
    body = b"x" * 5000
    with connect(served) as s:
        s.sendall(post("/e", b"", "Expect: 100-continue\r\n").replace(b"Length: 0", b"Length: 5000"))
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        assert responses(s, 1) == [(200, b"POST /e 5000 keep")]
    # not wanted: no 100 Continue, the refusal at once
    status, out = exchange(served, post("/unwanted", b"", "Expect: 100-continue\r\n").replace(
        b"Length: 0", b"Length: 5000"))
    assert status == 413 and b"100 Continue" not in out


def reset_is_cancelled(served) -> None:
    """A request whose client resets its connection (SO_LINGER 0) mid-answer: its handler is
    cancelled and the connection let go."""
    s = connect(served)
    s.sendall(get("/hold-reset"))
    wait_until(lambda: "/hold-reset" in served.running, 5, what="the request answered")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    wait_until(lambda: "/hold-reset" in served.cancelled, 5, what="the handler cancelled")
    wait_until(lambda: served.connections() == 0, 5, what="connections let go")


def test_a_handler_is_cancelled_when_its_client_goes(served):
    with connect(served) as s:  # closed: EOF
        s.sendall(get("/hold-eof"))
        wait_until(lambda: "/hold-eof" in served.running, 5, what="the request answered")
    wait_until(lambda: "/hold-eof" in served.cancelled, 5, what="the handler cancelled")
    reset_is_cancelled(served)


def test_close_answers_within_its_grace_then_cancels_and_closes_everything():
    served = Served()
    idle, held, late = connect(served), connect(served), connect(served)
    try:
        held.sendall(get("/hold-answered"))
        late.sendall(get("/hold-late"))
        wait_until(lambda: len(served.running) == 2, 5, what="both requests answered")
        closing = asyncio.run_coroutine_threadsafe(served.lst.close(0.5), served.loop)
        idle.settimeout(5)
        assert idle.recv(100) == b""  # a connection waiting for a request: closed at once
        served.release("/hold-answered")
        held.settimeout(5)
        out = to_close(held)  # answered, then closed
        assert out.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in out
        closing.result(10)
        assert served.cancelled == ["/hold-late"] and served.connections() == 0
        late.settimeout(5)
        assert to_close(late) == b""
    finally:
        for s in (idle, held, late):
            s.close()
        served.stop_loop()


def test_a_head_gets_the_head_alone_with_the_bodys_length_and_the_connection_carries_on(served):
    """The body went out after a HEAD's head: a client read it as the start of the next response."""
    with connect(served) as s:
        s.sendall(b"HEAD /big5 HTTP/1.1\r\nHost: x\r\n\r\n" + get("/after"))
        out = b""
        while not out.endswith(b"GET /after 0 keep"):
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
    first, second = out.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and first.endswith(b"Content-Length: 5\r\nConnection: keep-alive\r\n\r\n")
    assert second.startswith(b"200 ") and second.endswith(b"\r\n\r\nGET /after 0 keep")


def test_with_answer_after_eof_a_half_closed_client_is_answered_then_closed():
    """The console's listener: a script that sends its request and half-closes got nothing."""
    served = Served(answer_after_eof=True)
    try:
        with connect(served) as s:
            s.sendall(get("/hold-half") + get("/never"))
            s.shutdown(socket.SHUT_WR)
            wait_until(lambda: "/hold-half" in served.running, 5, what="the request answered")
            served.release("/hold-half")
            out = to_close(s)  # closed at once after the response, no linger
        assert out.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in out and out.count(b"HTTP/1.1 ") == 1
        assert served.cancelled == [] and [t for t, _, _ in served.seen] == ["/hold-half"]
        reset_is_cancelled(served)  # a reset still cancels
    finally:
        served.close()
