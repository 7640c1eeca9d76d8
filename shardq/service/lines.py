"""The supervisor's end of a shard's report pipe (:mod:`shardq.shard.report`): whole lines
out of raw reads.

The supervisor reads the pipe with ``os.read`` on its descriptor and splits lines here,
never through a buffered file object. A buffered ``readline()`` after a ``poll`` can pull
two lines out of the pipe and return one: the second then waits in a buffer that no
``poll`` reports, and the supervisor hears nothing more from that shard. That is how a
``pong`` written right after a compaction's last ``progress`` line got a healthy shard
SIGKILLed as hung, and how ``ready`` right after ``progress replay`` left ``start()``
waiting for its whole timeout.
"""
from __future__ import annotations

from ..shard.report import LINE_BYTES_MAX


class LineSplitter:
    """Bytes in, in the order read; every complete line out, in order, without its newline.

    Holds at most ``max_bytes`` of an unfinished line, so a shard can never make its
    supervisor's memory grow: a line longer than that (newline excluded) is dropped whole,
    shows as ``None`` where it would have been (once, as it goes over the limit), is counted
    in :attr:`dropped`, and the lines after it are split as usual."""

    def __init__(self, max_bytes: int = LINE_BYTES_MAX):
        self.max_bytes = max_bytes
        self.dropped = 0                 # lines over max_bytes, dropped so far
        self._partial = bytearray()      # the unfinished line, at most max_bytes
        self._skipping = False           # in a line already dropped: discard up to its newline

    def feed(self, data: bytes) -> list[bytes | None]:
        """The lines that ``data`` completes, and ``None`` for each line dropped."""
        lines: list[bytes | None] = []
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            if self._skipping:
                self._skipping = False   # counted when it went over the limit
            elif len(self._partial) + nl - start > self.max_bytes:
                self.dropped += 1
                lines.append(None)
            else:
                lines.append(bytes(self._partial) + data[start:nl])
            self._partial.clear()
            start = nl + 1
        rest = len(data) - start
        if self._skipping or not rest:
            return lines
        if len(self._partial) + rest > self.max_bytes:
            self.dropped += 1
            lines.append(None)
            self._partial.clear()
            self._skipping = True
        else:
            self._partial += data[start:]
        return lines

    def unfinished(self) -> int:
        """Bytes of a line begun but not ended (at EOF: the writer died in the middle of it)."""
        return len(self._partial)
