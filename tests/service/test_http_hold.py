"""The listener's ``hold_s`` (the SQS listener's): a worker that has answered keeps the
connection for the next request, answers it itself when it comes whole and plain, and hands
anything else back to the receiver with the bytes that came. In process, a small listener."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from shardq import limits
from shardq.service.http_listener import Listener, Request

HOLD_S = 0.2


def _get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture()
def listener(monkeypatch):
    monkeypatch.setattr(limits, "HTTP_CONNECTIONS_MAX", 4)  # hold_s needs a worker per connection
    _left.clear()
    seen: list[tuple[str, int, bytes]] = []

    def handle(req: Request) -> bool:
        assert req.head is not None
        body = req.data[req.head.body_at:] if req.body_ready else b""
        seen.append((req.head.target, threading.get_ident(), body))
        text = f"{req.head.target} {len(body)}".encode()
        if req.head.target.startswith("/big"):  # more than a socket's buffer takes at once
            text = text.ljust(int(req.head.target[4:]), b".")
        req.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
        return True
    lst = Listener(("127.0.0.1", 0), socket.AF_INET, handle, lambda method, path, head: True,
                   workers=4, hold_s=HOLD_S)
    lst.start()
    lst.seen = seen  # type: ignore[attr-defined]
    yield lst
    lst.stop()


_left: dict[int, bytes] = {}  # bytes read past the responses asked for, per socket


def _answers(s: socket.socket, n: int) -> list[bytes]:
    """The bodies of the next ``n`` responses on ``s``."""
    buf, out = _left.pop(s.fileno(), b""), []
    while len(out) < n:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            size = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            if len(rest) >= size:
                out.append(rest[:size])
                buf = rest[size:]
                continue
        chunk = s.recv(1 << 20)
        assert chunk, "closed"
        buf += chunk
    _left[s.fileno()] = buf
    return out


def test_the_next_request_is_answered_by_the_worker_that_answered_the_last(listener):
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(_get("/a"))
        assert _answers(s, 1) == [b"/a 0"]
        s.sendall(_post("/b", b"12345"))
        assert _answers(s, 1) == [b"/b 5"]
        s.sendall(_get("/c") + _post("/d", b"xy") + _get("/e"))  # pipelined: in order, each once
        assert _answers(s, 3) == [b"/c 0", b"/d 2", b"/e 0"]
    threads = {t for _, t, _ in listener.seen}
    assert len(threads) == 1, listener.seen


def test_what_does_not_come_whole_in_time_goes_back_to_the_receiver_with_its_bytes(listener):
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(_get("/a"))
        assert _answers(s, 1) == [b"/a 0"]
        nxt = _post("/half", b"0123456789")
        s.sendall(nxt[:20])  # part of the head: held past hold_s, then the receiver's
        time.sleep(HOLD_S * 2)  # what is under test is the hold's end: nothing to wait on
        s.sendall(nxt[20:-4])
        time.sleep(HOLD_S * 2)
        s.sendall(nxt[-4:])
        assert _answers(s, 1) == [b"/half 10"]
        time.sleep(HOLD_S * 2)  # idle past the hold: back to the receiver, which answers the next
        s.sendall(_get("/late"))
        assert _answers(s, 1) == [b"/late 0"]


def test_expect_100_continue_after_a_kept_request_is_the_receivers(listener):
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(_get("/a"))
        assert _answers(s, 1) == [b"/a 0"]
        s.sendall(_post("/expect", b"", "Expect: 100-continue\r\n").replace(b"Length: 0", b"Length: 3"))
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"abc")
        assert _answers(s, 1) == [b"/expect 3"]


def test_a_response_larger_than_the_socket_buffer_is_written_whole_to_a_slow_reader(listener):
    size = 32 * 1024 * 1024  # more than the two sockets' buffers hold
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(_get("/a") + _get(f"/big{size}") + _get("/c"))
        assert _answers(s, 1) == [b"/a 0"]
        time.sleep(0.2)  # the worker meets a full buffer: what is under test is its wait, not ours
        big, last = _answers(s, 2)
        assert len(big) == size and big.startswith(f"/big{size} 0".encode()) and last == b"/c 0"


def test_a_head_over_its_limit_after_a_kept_request_is_refused_with_431(listener):
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(_get("/a"))
        assert _answers(s, 1) == [b"/a 0"]
        s.sendall(_get("/big", "X-Pad: " + "p" * limits.HTTP_HEAD_BYTES_MAX + "\r\n"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 431 ")


def test_a_closed_connection_is_let_go_and_counted_out(listener):
    for _ in range(3):
        with socket.create_connection(listener.address, timeout=5) as s:
            s.sendall(_get("/a"))
            assert _answers(s, 1) == [b"/a 0"]
    deadline = time.monotonic() + 5
    while listener._answering and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener._answering == 0 and not listener._held


def test_hold_needs_a_worker_for_every_connection():
    with pytest.raises(ValueError):
        Listener(("127.0.0.1", 0), socket.AF_INET, lambda req: True, lambda method, path, head: True,
                 workers=limits.HTTP_CONNECTIONS_MAX - 1, hold_s=0.1)
