"""A scripted shard on a unix socket, for the client tests: drops, hangs and canned answers."""
from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Listener

import msgpack

from shardq.datadir import DataDir
from shardq.protocol import sockio, wire
from support.service import short_tmpdir


class FakeShard:
    """Serves shard 0 of a one-shard data dir. ``script`` is one action per connection:
    ``"drop"`` (read one frame, close, set ``dropped``), ``"hang"`` (read one frame, never
    answer), a function ``(op, args) -> result`` (answer every request of one frame with
    OK results) or ``("serve", function)`` (the same for every frame until the client
    closes). ``requests`` holds every request read, ``by_conn`` those of each connection."""

    def __init__(self, script):
        self.dd = DataDir(short_tmpdir())
        self.dd.init(1)
        self.script = list(script)
        self.requests: list[list] = []
        self.by_conn: list[list[list]] = []
        self.dropped = threading.Event()
        self.listener = Listener(self.dd.socket_path(0), "AF_UNIX", authkey=self.dd.authkey())
        self.conns = []
        self.closing = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        for action in self.script:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 - closed, or close()'s wake-up failed the handshake
                return
            if self.closing:
                conn.close()
                return
            conn.recv_bytes()  # the client's hello
            conn.send_bytes(sockio.ADMITTED)  # the shard's verdict that ends a handshake
            self.conns.append(conn)
            self.by_conn.append([])
            serve = type(action) is tuple
            while True:
                try:
                    reqs = msgpack.unpackb(conn.recv_bytes(), raw=False)
                except (EOFError, OSError):
                    break  # the client closed a connection this action serves
                if all(op == "queue_config" for _, op, _ in reqs):
                    # a router asks a queue's placement before its first enqueue of it
                    # (docs/limits.md): an unplaced queue, outside the script and the record
                    conn.send_bytes(msgpack.packb([[rid, wire.OK, {}] for rid, _, _ in reqs]))
                    continue
                self.requests.extend(reqs)
                self.by_conn[-1].extend(reqs)
                if action == "drop":
                    conn.close()
                    self.dropped.set()
                elif action != "hang":
                    answer = action[1] if serve else action
                    conn.send_bytes(msgpack.packb([[rid, wire.OK, answer(op, args)] for rid, op, args in reqs]))
                if not serve:
                    break

    def ops(self) -> list[str]:
        return [op for _, op, _ in self.requests]

    def close(self):
        # A script step the client never reached leaves the thread in accept(), which
        # closing the listener does not wake: a bare connection (no handshake) does.
        self.closing = True
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(self.dd.socket_path(0))
            except OSError:
                pass  # nobody listening any more
        self.listener.close()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the fake shard's thread did not end"
        for c in self.conns:
            c.close()
