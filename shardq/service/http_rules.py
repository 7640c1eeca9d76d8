"""What the HTTP listener (:mod:`.aio_listener`) decides, with no I/O: the refusals it sends
itself, the body-length rules of a request head, and the chunked-body decoder. The listener
moves the bytes, this says what they mean."""
from __future__ import annotations

from collections.abc import Callable

from .http_head import Head

CHUNKED = -2  # body_of's length for a chunked body
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def refusal(status: int, reason: str) -> bytes:
    """A whole plain-text response that closes the connection: what a listener sends by
    itself (400, 408, 413, 431, 503), before or instead of the handler."""
    text = f"{reason}\n".encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n").encode() + text


def body_of(head: Head, body_bytes_max: int,
            wants_body: Callable[[str, str, Head], bool]) -> tuple[int, bool, bool]:
    """(Content-Length or :data:`CHUNKED`, or -1 when neither can be read; whether to read the
    body; whether the client expects 100 Continue first). A head the handler will refuse (a
    transfer coding other than chunked or beside a Content-Length, a Content-Length that is
    not a number or over ``body_bytes_max``, not authenticated: ``wants_body`` says no) gets
    no body read, and its connection is not kept alive after the answer: the body is still on
    the wire. ``wants_body`` is asked only for a body that could be read."""
    coding = head.get_all("Transfer-Encoding") or []
    try:
        length = int(head.get("Content-Length") or 0) if not coding else CHUNKED
    except ValueError:
        return -1, False, False
    if coding and ([c.strip().lower() for c in coding] != ["chunked"] or "Content-Length" in head):
        return -1, False, False  # a coding we do not decode, or a smuggling attempt: never read
    if not (0 < length <= body_bytes_max or length == CHUNKED):
        return length, False, False
    expects = (head.get("Expect") or "").lower() == "100-continue"
    return length, wants_body(head.method, head.target.partition("?")[0], head), expects


class ChunkedBody:
    """A ``Transfer-Encoding: chunked`` body (RFC 9112, 7.1), decoded as its bytes arrive.

    :meth:`feed` takes what the connection's buffer holds from an offset on and returns
    how far it got; the caller drops those bytes, so what is held is the decoded body (at
    most ``limit`` bytes) and less than one read of the raw stream. Chunk extensions and
    trailer fields are read and dropped. ``status`` is set when the body is refused: 413
    once the chunk sizes add up past ``limit`` (before its bytes are read), 400 for a
    malformed chunk."""

    LINE_MAX = 4096  # a chunk-size line, or a trailer field

    def __init__(self, limit: int):
        self.limit = limit
        self.body = bytearray()
        self.left = 0            # bytes of the current chunk's data still to come
        self.crlf = False        # the CRLF after a chunk's data is due
        self.trailers = False    # the last chunk came: trailer fields until a blank line
        self.done = False
        self.status = 0          # 400 or 413 once refused

    @property
    def reason(self) -> str:
        """The refusal's reason phrase for :attr:`status`."""
        return "Content Too Large" if self.status == 413 else "Bad Request"

    def feed(self, buf: bytes | bytearray, pos: int) -> int:
        while not (self.done or self.status):
            if self.left:
                take = min(self.left, len(buf) - pos)
                self.body += buf[pos:pos + take]
                pos, self.left = pos + take, self.left - take
                if self.left:
                    return pos
                self.crlf = True
            if self.crlf:
                if len(buf) - pos < 2:
                    return pos
                if buf[pos:pos + 2] != b"\r\n":
                    self.status = 400
                    return pos
                pos, self.crlf = pos + 2, False
            end = buf.find(b"\r\n", pos, pos + self.LINE_MAX + 2)
            if end < 0:
                if len(buf) - pos > self.LINE_MAX:
                    self.status = 400
                return pos
            line, pos = bytes(buf[pos:end]), end + 2
            if self.trailers:
                self.done = not line
                continue
            size = line.split(b";", 1)[0].strip()
            if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
                self.status = 400
            elif len(self.body) + int(size, 16) > self.limit:
                self.status = 413
            else:
                self.left = int(size, 16)
                self.trailers = self.left == 0
        return pos
