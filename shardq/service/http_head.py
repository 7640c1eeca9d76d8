"""A request head, read once and fast: the request line and the headers, names compared
without case, as ``email.message.Message`` answers ``get`` and ``get_all`` (what the
listener's body check, the handlers and the SigV4 check ask). The HTTP listener
(:mod:`.aio_listener`) parses each head once with it and hands it on with the request: the
stdlib's parser (``http.client.parse_headers``) cost 40% of a small request's handling, and
the listener and the SQS handler each ran a parser."""
from __future__ import annotations

import re

HEAD_END = re.compile(rb"\r?\n\r?\n")  # the blank line, as the listener finds it
# The usual head, read by two regular expressions instead of a few calls a line: a request
# line of three words, fields "token: value" (value without a CR, and stripped as str.strip
# strips: \s is the same set of characters), lines ending in CRLF or LF. Any other head
# (a folded line, stray whitespace, a CR inside a line) is read line by line, as before.
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_WS = r"[^\S\r\n]*"  # whitespace within a line
_FIELD = rf"({_TOKEN}):{_WS}((?:[^\r\n]*\S)?){_WS}\r?\n"
_USUAL = re.compile(rf"(\S+)[ \t]+(\S+)[ \t]+(HTTP/1\.\S*)[ \t]*\r?\n((?:{_TOKEN}:[^\r\n]*\r?\n)*)\r?\n")
_FIELDS = re.compile(_FIELD)


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

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._fields

    def field_count(self) -> int:
        """Header fields in the head (a name sent twice counts twice)."""
        return sum(map(len, self._fields.values()))


def parse(data: bytes | bytearray) -> Head | None:
    """The head at the start of ``data`` (which the listener has checked ends with a blank
    line within its limit); None for one that is not an HTTP/1.x request head."""
    m = HEAD_END.search(data)
    if m is None or m.start() == 0:
        return None
    usual = _USUAL.fullmatch(data[:m.end()].decode("latin-1"))
    if usual is not None:
        method, target, version, block = usual.groups()
        fields: dict[str, list[str]] = {}
        for name, value in _FIELDS.findall(block):
            name = name.lower()
            if name in fields:
                fields[name].append(value)
            else:
                fields[name] = [value]
        return Head(method, target, version, fields, m.end())
    return _parse_lines(data, m)


def _parse_lines(data: bytes | bytearray, m: re.Match[bytes]) -> Head | None:
    # lines end in \r\n or \n; the last one's end is in the match already
    lines = data[:m.start()].decode("latin-1").split("\n")
    last_line = lines.pop()
    lines = [line[:-1] if line[-1:] == "\r" else line for line in lines]
    lines.append(last_line)
    request = lines[0].split()
    if len(request) != 3 or not request[2].startswith("HTTP/1."):
        return None
    fields: dict[str, list[str]] = {}
    last: list[str] | None = None
    for text in lines[1:]:
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
    return Head(request[0], request[1], request[2], fields, m.end())
