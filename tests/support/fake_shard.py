"""Scripted shards on unix sockets, for the client tests: the real handshake and framing,
replies chosen per request, and drops and hangs per connection."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Listener
from typing import Any

import msgpack

from shardq.datadir import DataDir
from shardq.protocol import sockio, wire
from support.service import short_tmpdir


class Refuse:
    """A reply of error ``name`` (a class of shardq.errors, as a shard sends it)."""

    def __init__(self, name: str):
        self.name = name


class FakeShards:
    """Serves every shard of a new ``shards``-shard data dir, each connection in a thread of
    its own.

    ``answer(shard, op, args)`` gives each request's result, or a :class:`Refuse`. Or
    ``script``: one action per connection, in the order they come (then no more are
    accepted): ``"drop"`` (read one frame, close, set ``dropped``), ``"hang"`` (read one
    frame, never answer), a function ``(op, args) -> result`` (answer every request of one
    frame) or ``("serve", function)`` (the same for every frame until the client closes).

    A client asks a queue's placement (``queue_config``) before its first enqueue of it
    (docs/limits.md): an unplaced queue is answered, outside the script and the record,
    unless ``answers_placement`` (then it goes to ``answer`` like any op). ``requests``
    holds ``(shard, op, args)`` of every request read, ``by_conn`` those of each
    connection, ``frames`` the length of every frame read."""

    def __init__(self, shards: int = 1, answer: Callable[[int, str, list[Any]], Any] | None = None, *,
                 script: Sequence[Any] | None = None):
        self.dd = DataDir(short_tmpdir())
        self.dd.init(shards)
        self.answer = answer
        self.script = None if script is None else list(script)
        self.answers_placement = False
        self.requests: list[tuple[int, str, list[Any]]] = []
        self.by_conn: list[list[tuple[int, str, list[Any]]]] = []
        self.frames: list[int] = []
        self.dropped = threading.Event()
        self.lock = threading.Lock()
        self.closing = False
        self.conns: list[Any] = []
        self.listeners = [Listener(self.dd.socket_path(i), "AF_UNIX", authkey=self.dd.authkey())
                          for i in range(shards)]
        self.threads = [threading.Thread(target=self._accept, args=(i,), daemon=True) for i in range(shards)]
        for t in self.threads:
            t.start()

    def _accept(self, shard: int) -> None:
        while True:
            with self.lock:
                if self.script == []:
                    return  # every scripted connection was made
            try:
                conn = self.listeners[shard].accept()
            except Exception:  # noqa: BLE001 - closed, or close()'s wake-up failed the handshake
                return
            if self.closing:
                conn.close()
                return
            conn.recv_bytes()  # the client's hello
            conn.send_bytes(sockio.ADMITTED)  # the shard's verdict that ends a handshake
            with self.lock:
                self.conns.append(conn)
                self.by_conn.append([])
                mine = self.by_conn[-1]
                action = self.script.pop(0) if self.script else ("serve", None)
            threading.Thread(target=self._serve, args=(shard, conn, action, mine), daemon=True).start()

    def _serve(self, shard: int, conn: Any, action: Any, mine: list[tuple[int, str, list[Any]]]) -> None:
        serve = type(action) is tuple
        if serve and action[1] is not None:
            action = action[1]
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the client closed a connection this action serves
            requests = msgpack.unpackb(data, raw=False)
            placement = not self.answers_placement and all(op == "queue_config" for _, op, _ in requests)
            replies = []
            for rid, op, args in requests:
                if op == "queue_config" and not self.answers_placement:
                    replies.append([rid, wire.OK, {}])  # an unplaced queue, not counted among the requests
                    continue
                with self.lock:
                    self.requests.append((shard, op, args))
                    mine.append((shard, op, args))
                if action in ("drop", "hang"):
                    continue
                result = self.answer(shard, op, args) if action == ("serve", None) else action(op, args)
                if isinstance(result, Refuse):
                    replies.append([rid, wire.ERR, [result.name, f"shard {shard} refuses {op} (test)"]])
                else:
                    replies.append([rid, wire.OK, result])
            if not placement:
                with self.lock:
                    self.frames.append(len(data))
            if action == "drop" and not placement:
                conn.close()
                self.dropped.set()
                return
            if action != "hang" or placement:
                try:
                    conn.send_bytes(msgpack.packb(replies))
                except OSError:
                    return
            if not serve and not placement:
                return  # one frame played: the connection stays open, unread

    def sent(self, *ops: str) -> list[tuple[int, str, list[Any]]]:
        with self.lock:
            return [r for r in self.requests if r[1] in ops]

    def ops(self) -> list[str]:
        return [op for _, op, _ in self.requests]

    def down(self, shard: int) -> None:
        """Stop listening for ``shard`` (its connections stay): a client's connect fails
        as when a shard process is down. :meth:`up` listens again."""
        listener = self.listeners[shard]
        with socket.socket(socket.AF_UNIX) as s:  # wakes its accept() (see close)
            s.settimeout(1.0)
            s.connect(self.dd.socket_path(shard))
        self.closing = True
        self.threads[shard].join(5)
        self.closing = False
        listener.close()

    def up(self, shard: int) -> None:
        """Listen for ``shard`` again after :meth:`down`."""
        self.listeners[shard] = Listener(self.dd.socket_path(shard), "AF_UNIX", authkey=self.dd.authkey())
        self.threads[shard] = threading.Thread(target=self._accept, args=(shard,), daemon=True)
        self.threads[shard].start()

    def close(self) -> None:
        # A thread waiting in accept() is not woken by closing the listener: a bare
        # connection (no handshake) does.
        self.closing = True
        for i, listener in enumerate(self.listeners):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)  # a backlog a client's reconnects filled would block it for ever
                try:
                    s.connect(self.dd.socket_path(i))
                except OSError:
                    pass  # nobody listening any more
            listener.close()
        for t in self.threads:
            t.join(5)
            assert not t.is_alive(), "a fake shard's accept thread did not end"
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass  # its serve thread closed it at the same moment (a "drop")
