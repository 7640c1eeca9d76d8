"""``python -m shardq.sqs_api.child``: one SQS listener process of ``shardq serve`` when
``[sqs_api] processes`` is above 1 (:mod:`.processes` starts and restarts them).

It serves the listening socket ``serve`` bound (inherited as ``--fd``): the kernel hands
each new connection to one of the processes waiting on it. The ``[sqs_api]`` table comes as
one line of JSON on stdin, never on the command line (which every local user can read: it
may hold the secret key). It answers ``ready`` on stdout once it serves, and ends when stdin
closes (``serve`` stops it so), on SIGTERM, or with ``serve`` (``PR_SET_PDEATHSIG``)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading

from ..busypoll import BUSY_POLL_US_DEFAULT
from ..config import SqsApiConfig
from ..stopping import die_with_parent

READY = b"ready\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardq.sqs_api.child")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--busy-poll-us", type=int, default=BUSY_POLL_US_DEFAULT, help="[service] busy_poll_us")
    a = p.parse_args(argv)
    if a.parent_pid:
        die_with_parent(a.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s sqs-api-{a.index} pid={os.getpid()} %(levelname)s %(message)s")
    cfg = SqsApiConfig(**json.loads(sys.stdin.buffer.readline()))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches serve, which stops us
    from .server import SqsService, tune_gc
    svc = SqsService(a.data_dir, cfg, busy_poll_us=a.busy_poll_us).start(sock=socket.socket(fileno=a.fd))
    tune_gc()
    try:
        os.write(sys.stdout.fileno(), READY)

        def watch_stdin() -> None:
            while os.read(sys.stdin.fileno(), 4096):
                pass
            done.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
        done.wait()
    finally:
        svc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
