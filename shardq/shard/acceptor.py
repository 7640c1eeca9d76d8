"""The shard's acceptor: takes new connections off the listening socket and authenticates
each on a short-lived thread of its own (the HMAC challenge of ``multiprocessing.connection``,
bounded by a socket timeout), so a silent or hostile client never stalls the shard loop.
At most ``HANDSHAKES_MAX`` handshakes run at once; when a new connection finds them all
taken, the oldest is dropped to make room (a client that answers takes about a millisecond,
so only a silent one is ever that old): connections that never speak delay a newcomer by
one handshake, not by their whole timeout.
Authenticated connections are handed to the loop through ``deliver``, each holding one of
the shard's :class:`ConnectionSlots`; past ``limits.max_connections`` a client is turned
away at the end of its handshake (:data:`~.sockio.TURNED_AWAY`), before it sends anything.

Guarantee: running out of descriptors (EMFILE, ENFILE), memory or buffers (ENOMEM,
ENOBUFS) or threads never ends the acceptor. It backs off (10 ms doubling to 1 s; new
connections wait in the listen backlog meanwhile), warns at most every 10 s, and accepts
again as soon as something is freed. Each kind of trouble (out of resources, handshakes
evicted, clients turned away) has its own 10 s: a flood of silent connections, which
evicts handshakes first, must not keep the log from saying that descriptors ran out.
Every descriptor it makes is closed on every path. Only a closed listener ends it.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from ..clock import Clock, SystemClock
from .conn import FrameConn
from ..protocol.sockio import (ADMITTED, HANDSHAKE_TIMEOUT_S, TURNED_AWAY, VERDICT_BYTES_MAX, role_of, shut,
                               socket_timeouts)

log = logging.getLogger("shardq.shard")

HANDSHAKES_MAX = 32
#: Connections of ``shardq serve``'s own parts (the HTTP listener, schedules), held apart
#: from the clients' limit. (Its health pings use the shard's stdin pipe, not the socket.)
SERVICE_CONNECTIONS_MAX = 16
#: accept() errors that mean "out of descriptors, memory or buffers for now": back off, retry
EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
#: accept() errors about one connection (it was reset before we took it): take the next
_ONE_CONNECTION = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EPERM)
#: How long a new connection waits for the turn an evicted handshake gives back.
EVICT_WAIT_S = 1.0
ACCEPT_BACKOFF_S_MIN = 0.01
ACCEPT_BACKOFF_S_MAX = 1.0
TROUBLE_LOG_EVERY_S = 10.0


class Throttled:
    """A recurring warning logged at most once every ``every_s`` seconds, with how many
    times it happened in between (a flood must not become a flood of log lines)."""

    def __init__(self, clock: Clock, every_s: float = TROUBLE_LOG_EVERY_S):
        self.clock = clock
        self.every_s = every_s
        self.last: float | None = None
        self.unlogged = 0
        self._lock = threading.Lock()

    def warn(self, msg: str, *args: object) -> None:
        with self._lock:
            now = self.clock.monotonic()
            if self.last is not None and now - self.last < self.every_s:
                self.unlogged += 1
                return
            more, self.unlogged, self.last = self.unlogged, 0, now
        log.warning(msg + (f" ({more} more since the last report)" if more else ""), *args)


class ConnectionSlots:
    """The connections of one role a shard holds, counted against ``limit``: the acceptor
    takes a slot before it admits one, the loop gives it back when it drops the connection.
    So the shard never holds more than ``limit``, however many connect at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.turned_away = 0  # clients refused for want of a slot, since the shard started
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.held >= self.limit:
                self.turned_away += 1
                return False
            self.held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.held -= 1


class Acceptor(threading.Thread):
    """Accepts sockets and authenticates each on its own short-lived thread (see above)."""

    def __init__(self, listener: socket.socket, authkey: bytes, deliver: Callable[[FrameConn], None],
                 clock: Clock | None = None, slots: dict[str, ConnectionSlots] | None = None):
        super().__init__(name="shardq-acceptor", daemon=True)
        self.listener = listener
        self.authkey = authkey
        self.deliver = deliver
        #: a pool per role (sockio.ROLES); each connection delivered holds a slot of its role's
        self.slots = slots or {"client": ConnectionSlots(2**31), "service": ConnectionSlots(SERVICE_CONNECTIONS_MAX)}
        self.busy = threading.BoundedSemaphore(HANDSHAKES_MAX)
        # handshakes in progress: id -> (when it began, its descriptor). The lock is held
        # while a handshake's descriptor is closed, so an eviction never shuts a reused one.
        self._pending: dict[int, tuple[float, int]] = {}
        self._pending_lock = threading.Lock()
        self._ids = 0
        self.evicted = 0
        self.clock = clock or SystemClock()
        self.trouble = Throttled(self.clock)  # out of descriptors, memory, buffers or threads
        self.crowded = Throttled(self.clock)  # a handshake evicted for a newcomer
        self.full = Throttled(self.clock)     # a connection turned away at its role's limit
        self.failures = 0  # in a row, since the last connection accepted

    def run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError as e:
                if e.errno in EXHAUSTED:
                    self._back_off(f"accept failed: {e.strerror}")
                    continue
                if e.errno in _ONE_CONNECTION:
                    continue
                return  # listener closed: shutting down
            if self.failures:
                log.info("accepting connections again after %d failed attempts", self.failures)
                self.failures = 0
            if not self.busy.acquire(blocking=False) and not (
                    self._evict_oldest() and self.busy.acquire(timeout=EVICT_WAIT_S)):
                sock.close()  # a flood of connections: refuse rather than queue without bound
                continue
            try:
                threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()
            except RuntimeError as e:  # "can't start new thread": out of memory or a limit
                self.busy.release()
                sock.close()
                self._back_off(f"cannot start a handshake thread: {e}")

    def _evict_oldest(self) -> bool:
        """Shut the socket of the oldest handshake (its thread then fails its read, closes
        and gives its turn back); False if there is none."""
        with self._pending_lock:
            if not self._pending:
                return False
            key = min(self._pending, key=lambda k: self._pending[k][0])
            _, fd = self._pending.pop(key)
            shut(fd)  # (nothing if it finished meanwhile)
        self.evicted += 1
        self.crowded.warn("all %d handshakes were waiting: dropped the oldest to let a new client in "
                          "(connections that do not authenticate)", HANDSHAKES_MAX)
        return True

    def _back_off(self, what: str) -> None:
        self.failures += 1
        delay = min(ACCEPT_BACKOFF_S_MIN * 2 ** min(self.failures - 1, 20), ACCEPT_BACKOFF_S_MAX)
        self.trouble.warn("%s; new clients wait (retrying in %.2f s; connected clients are served)",
                          what, delay)
        time.sleep(delay)

    def _handshake(self, sock: socket.socket) -> None:
        with self._pending_lock:
            self._ids += 1
            key = self._ids
        try:
            fd = sock.detach()
            conn = Connection(fd)  # owns fd from here on: closed below whatever happens
            with self._pending_lock:
                self._pending[key] = (self.clock.monotonic(), fd)
            try:
                socket_timeouts(fd, HANDSHAKE_TIMEOUT_S)
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
                role = role_of(conn.recv_bytes(VERDICT_BYTES_MAX))
                if role is None:
                    raise ValueError("no hello after authentication (a client of another wire version?)")
                slots = self.slots[role]
                if not slots.take():
                    self._turn_away(conn, role, slots.limit)
                    return
                try:
                    conn.send_bytes(ADMITTED)
                    socket_timeouts(fd, 0)
                    own = os.dup(fd)  # the loop's own descriptor; the Connection object is done
                except BaseException:
                    slots.give_back()
                    raise
            except OSError as e:
                if e.errno in EXHAUSTED:
                    self.trouble.warn("client dropped after authentication: %s", e.strerror)
                else:
                    log.warning("client rejected during authentication: %s", e or type(e).__name__)
                return
            except (AuthenticationError, EOFError, ValueError) as e:
                log.warning("client rejected during authentication: %s", e or type(e).__name__)
                return
            finally:
                with self._pending_lock:
                    self._pending.pop(key, None)
                    conn.close()
            fc = FrameConn(own)
            fc.slots = slots
            fc.role = role
            self.deliver(fc)
        finally:
            self.busy.release()

    def _turn_away(self, conn: Connection, role: str, n: int) -> None:
        """Tell a client the shard is full (it raises TooManyConnections), then close."""
        if role == "client":
            self.full.warn("turned a client away: this shard holds its limit of %d connections "
                              "(limits.max_connections)", n)
            why = (f"the shard holds its limit of {n} client connections (limits.max_connections); "
                   f"close idle routers or raise the limit")
        else:
            self.full.warn("turned a service connection away: this shard holds %d of them", n)
            why = f"the shard holds its {n} service connections"
        try:
            conn.send_bytes(TURNED_AWAY + why.encode())
        except OSError:
            pass  # the client left first: nothing to tell
