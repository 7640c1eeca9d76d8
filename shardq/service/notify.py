"""The sd_notify protocol, spoken by ``shardq serve`` to a service manager (systemd).

When ``NOTIFY_SOCKET`` names a unix datagram socket (a path, or ``@name`` for the abstract
namespace), each message is one datagram of ``KEY=value`` lines: ``READY=1``,
``STATUS=...``, ``WATCHDOG=1``, ``RELOADING=1``, ``STOPPING=1``, ``EXTEND_TIMEOUT_USEC=N``.
Without it every call is a no-op, so the same code runs under systemd, in a terminal and
in tests. Sending never raises and never blocks: a manager that is gone or slow must not
stop the service (a lost message is at worst a missed watchdog ping, which systemd
answers with the restart it would do anyway).

``WATCHDOG_USEC`` (with ``WATCHDOG_PID``, when set, naming this process) asks for a
``WATCHDOG=1`` at least that often; :meth:`Notifier.watchdog` sends one every half of
it, as sd_watchdog_enabled(3) advises. What the service says and when it counts as
healthy is the supervisor's call (:mod:`.supervisor`); this module only speaks the protocol
and paces it, on a monotonic clock the caller passes in.

No dependency: the protocol is a datagram of text, and the 20 lines here are tested
against a socket the tests bind.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping

#: the environment variables of the protocol; a child process must not inherit them (it
#: would speak for the service: systemd's sd_notify(3) unsets them after reading)
ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: a STATUS= whose only change is a figure (queue depth) goes out at most this often
STATUS_INTERVAL_S = 1.0


def send(address: str | None, *lines: str) -> bool:
    """One datagram of ``lines`` to ``address`` (a path, or ``@abstract``). True if it was
    sent; False if there is no address or it could not be sent. Never raises, never blocks."""
    if not address or address[0] not in "/@":
        return False  # unset, or a kind of address this client does not speak (vsock:)
    target = "\0" + address[1:] if address[0] == "@" else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, target)
        return True
    except OSError:
        return False


def watchdog_interval_s(env: Mapping[str, str]) -> float | None:
    """The interval ``WATCHDOG_USEC`` asks for, in seconds; None when unset, invalid, zero,
    or meant for another process (``WATCHDOG_PID``)."""
    pid = env.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


class Notifier:
    """The service's end of the protocol: what to send is the caller's, this paces it.

    * :meth:`status` sends a ``STATUS=`` at once when its ``headline`` (the shards' part)
      changes, and a change of the rest (figures) at most every :data:`STATUS_INTERVAL_S`.
    * :meth:`watchdog` sends ``WATCHDOG=1`` when half the interval has passed since the
      last one; the caller calls it only while the service is healthy.
    """

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_s = watchdog_interval_s(env) if self.address else None
        self.sent = 0                     # datagrams sent (tests, logs)
        self._status: tuple[str, str] | None = None
        self._status_at = float("-inf")
        self._watchdog_at = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        ok = send(self.address, *lines)
        self.sent += ok
        return ok

    def status(self, headline: str, rest: str, now: float, *extra: str, force: bool = False) -> None:
        """``STATUS=<headline><rest>`` if it says something new, paced; with ``force``, now
        and with the ``extra`` lines (``READY=1``) in the same datagram."""
        if not self.enabled or (not force and self._status == (headline, rest)):
            return
        if (not force and self._status is not None and self._status[0] == headline
                and now - self._status_at < STATUS_INTERVAL_S):
            return  # only a figure changed: wait for the interval
        if self.send(f"STATUS={headline}{rest}", *extra):
            self._status, self._status_at = (headline, rest), now

    def watchdog(self, now: float) -> None:
        """``WATCHDOG=1`` if half the interval has passed since the last one."""
        if self.watchdog_s is not None and now - self._watchdog_at >= self.watchdog_s / 2:
            if self.send("WATCHDOG=1"):
                self._watchdog_at = now

    def due_in(self, now: float) -> float | None:
        """Seconds until a watchdog ping is due (the caller's loop wakes by then); None if none is asked for."""
        if self.watchdog_s is None:
            return None
        return max(self._watchdog_at + self.watchdog_s / 2 - now, 0.0)
