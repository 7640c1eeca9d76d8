"""A request head, read once and fast: the request line and the headers, names compared
without case, as ``email.message.Message`` answers ``get`` and ``get_all`` (what the
handler and the SigV4 check ask). The stdlib's parser (``http.client.parse_headers``) cost
40% of a small request's handling; this one does what a request to this listener needs."""
from __future__ import annotations

import re

_LINE_END = re.compile(rb"\r?\n")


class Head:
    """``method``, ``target``, ``version``; ``body_at``: where the body starts in the data."""

    __slots__ = ("method", "target", "version", "body_at", "_fields")

    def __init__(self, method: str, target: str, version: str, fields: dict[str, list[str]], body_at: int):
        self.method, self.target, self.version, self.body_at = method, target, version, body_at
        self._fields = fields

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self._fields.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str] | None:
        return self._fields.get(name.lower())


def parse(data: bytes) -> Head | None:
    """The head at the start of ``data`` (which the Listener has checked ends with a blank
    line within its limit); None for one that is not an HTTP/1.x request head."""
    lines: list[bytes] = []
    pos = 0
    while True:
        m = _LINE_END.search(data, pos)
        if m is None:
            return None
        line = data[pos:m.start()]
        pos = m.end()
        if not line:
            break
        lines.append(line)
    if not lines:
        return None
    request = lines[0].decode("latin-1").split()
    if len(request) != 3 or not request[2].startswith("HTTP/1."):
        return None
    fields: dict[str, list[str]] = {}
    last: list[str] | None = None
    for raw in lines[1:]:
        text = raw.decode("latin-1")
        if text[:1] in (" ", "\t"):  # an obsolete folded continuation of the line before
            if last is None:
                return None
            last[-1] += " " + text.strip()
            continue
        name, sep, value = text.partition(":")
        if not sep or not name or name != name.strip():
            return None
        last = fields.setdefault(name.lower(), [])
        last.append(value.strip())
    return Head(request[0], request[1], request[2], fields, pos)
