"""A real SQS-compatible server for tests: ``moto_server`` as a child process on 127.0.0.1.

Why a subprocess rather than ``ThreadedMotoServer``: the tests measure leases of one or two
seconds, and a server thread inside the test process would share its GIL with the test and
its clients (and with the keeper threads of the backend under test), so a busy test could
stall the server past a deadline. A child process is also reachable the same way from the
``shardq worker`` subprocesses the tests SIGKILL, and it is ended by PID whatever happens.
It binds port 0; the port is read from its startup line, so parallel sessions never collide.

Three changes to moto, made when this file runs as the server. One: **ReceiveMessage is made atomic
per queue**. moto's is not: two receives running at once in its threaded server can both
see a message group as free and hand it, even the same message, to two consumers (AWS
never does). No client can undo that, and the races made the several-consumer tests fail
now and then, so the server is started with a per-queue lock around ReceiveMessage.
A second: **a visibility timeout changed to 0 makes the message visible at once**, as on AWS;
moto compares the clock with ``>`` and, when two reads return the same value, keeps the
message pending, which reorders its group's redelivery. A third: **ChangeMessageVisibility
takes only the message's latest receipt handle**, as on AWS; moto takes any handle the message
ever had, so a consumer stopped while its receive was answered, which restarts the visibility
as it wakes, held the message beside the consumer it went to meanwhile (a double lease that
``shardq verify --target`` found). Everything else moto answers is moto as shipped; its
deterministic differences from AWS are the strict xfail cases (docs/scale-out.md lists them
and the three changes). Two more changes only make the server faster (every SQS test waits on it):
requests are routed without listing moto's package directory each time, and the clock is
read with ``time.time()``, the same seconds moto's datetime arithmetic computes, several
times per message held on every request.
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile

if not __package__:  # run as a script (the moto server's process): tests/ is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.service import wait_until  # noqa: E402 - after the sys.path line above

_PORT_LINE = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")
_prefixes = itertools.count(1)


class MotoServer:
    """``python -m moto.server`` on a free port. Use as a context manager."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.log_path = tempfile.mktemp(prefix="moto-", suffix=".log", dir="/tmp")

    def start(self, timeout: float = 60.0) -> MotoServer:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "-H", "127.0.0.1", "-p", "0"],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            port = wait_until(self._port, timeout, 0.05, "moto_server to listen")
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def _port(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"moto_server exited with {self.proc.returncode}: {self.tail()}")
        with open(self.log_path, "rb") as f:
            m = _PORT_LINE.search(f.read())
        return int(m.group(1)) if m else None

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def target(self, prefix: str | None = None, region: str = "us-east-1") -> str:
        """A fresh ``sqs://`` target on this server (a new queue-name prefix each call)."""
        prefix = prefix or f"t{os.getpid()}x{next(_prefixes)}"
        return f"sqs://{region}/{prefix}?endpoint={self.endpoint}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def init_queues(target: str, config: dict) -> list[str]:
    """``shardq sqs init`` for a config dict (the TOML schema), in process."""
    from shardq import config as config_mod
    from shardq.backends.sqs_admin import init
    from shardq.backends.sqs_client import Api
    from shardq.backends.sqs_mapping import parse_target
    return init(Api(parse_target(target)), config_mod.parse(config))


def fresh_target(server: MotoServer, config: dict) -> str:
    """A new prefix on ``server`` with the queues of ``config`` created."""
    target = server.target()
    init_queues(target, config)
    return target


def raw_client(target: str):
    """A plain boto3 SQS client for ``target`` (to look at the server behind the backend)."""
    from shardq.backends.sqs_client import make_client
    from shardq.backends.sqs_mapping import parse_target
    return make_client(parse_target(target), request_timeout_s=10, max_attempts=1)


def serve_with_atomic_receive(argv: list[str]) -> None:
    """Run ``moto.server`` with ReceiveMessage atomic per queue, the two other fixes and the
    two speed-ups (see the module docstring).
    The scan runs under the queue's lock; a long poll waits outside it, as moto's own loop
    does between scans, so one waiting consumer never holds up another."""
    import threading
    import time
    from collections import defaultdict

    from moto import backends
    from moto.server import main
    from moto.sqs import models

    # moto lists its package directory on every request to route it (a few ms of this
    # server's CPU per request, in every SQS test); the list cannot change while it runs.
    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules
    # moto's SQS reads the clock several times per message held, on every request, through
    # datetime arithmetic (and an import) per read: the same seconds from time.time().
    shipped_unix_time = models.unix_time

    def unix_time(dt=None):
        return time.time() if dt is None else shipped_unix_time(dt)

    models.unix_time = unix_time
    models.unix_time_millis = lambda dt=None: unix_time(dt) * 1000.0
    # ChangeMessageVisibility to 0 must leave the message visible at once (AWS). moto sets
    # visible_at = now and then asks `now > visible_at`: when the clock reads the same float
    # twice (about 1 in 10 nacks here) the message stays "pending", and moto's receive then
    # hands out the group's last pending message before its head.
    models.Message.visible = property(lambda self: models.unix_time_millis() >= self.visible_at)

    # ChangeMessageVisibility takes only the message's latest receipt handle (AWS: each
    # receive issues a new handle and the old one is invalid). moto takes any handle the
    # message ever had, so a consumer that was stopped while its receive was answered, and
    # restarts the visibility as it wakes, held the message beside its next consumer.
    change_visibility = models.SQSBackend.change_message_visibility

    def change_visibility_of_latest(self, queue_name, receipt_handle, visibility_timeout):
        for message in self.get_queue(queue_name)._messages:
            if message.had_receipt_handle(receipt_handle) and message.receipt_handle != receipt_handle:
                raise models.ReceiptHandleIsInvalid
        return change_visibility(self, queue_name, receipt_handle, visibility_timeout)

    models.SQSBackend.change_message_visibility = change_visibility_of_latest

    locks: defaultdict = defaultdict(threading.Lock)
    guard = threading.Lock()
    receive = models.SQSBackend.receive_message
    poll_s = 0.05  # between scans while messages exist but none may be handed out

    def atomic_receive(self, queue_name, count, wait_seconds_timeout, visibility_timeout, *args, **kwargs):
        with guard:
            lock = locks[(id(self), queue_name)]
        deadline = time.monotonic() + (wait_seconds_timeout or 0)
        while True:
            with lock:
                result = receive(self, queue_name, count, 0, visibility_timeout, *args, **kwargs)
            left = deadline - time.monotonic()
            if result or left <= 0:
                return result
            t0 = time.monotonic()
            self.get_queue(queue_name).wait_for_messages(min(left, 1.0))
            if time.monotonic() - t0 < poll_s:
                time.sleep(min(poll_s, max(left, 0)))

    models.SQSBackend.receive_message = atomic_receive
    main(argv)


if __name__ == "__main__":
    serve_with_atomic_receive(sys.argv[1:])
