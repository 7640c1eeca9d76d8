"""The sockets and address files of serve's HTTP listeners (the console's and the SQS API's,
both on :class:`.aio_listener.AioListener`): bind before any shard starts, so a port that is
taken stops ``serve`` at once; publish where a listener is, whole, for ``shardq console`` and
the tests to find."""
from __future__ import annotations

import json
import os
import socket
from typing import Any


def bind(address: tuple[Any, ...], family: int) -> socket.socket:
    """A TCP socket bound to ``address`` and listening (connections wait in its backlog
    until a listener serves it); OSError (EADDRINUSE...) with nothing left open."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def publish_address(run_dir: str, name: str, info: dict[str, object]) -> str:
    """Write ``info`` as JSON to ``run_dir/name`` whole (a temp file renamed over it), so a
    reader never sees half of it; the path, for :func:`unpublish_address`."""
    path = os.path.join(run_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    return path


def unpublish_address(path: str | None) -> None:
    """Remove a file :func:`publish_address` wrote (gone already: nothing to do)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
