"""``shardq console``: print the URL that opens the running service's web console logged in
(``http://127.0.0.1:7781/login?token=...``), read from the listener's address file and the
token (``[http] token``, ``SHARDQ_HTTP_TOKEN``, else ``<data dir>/http-token``)."""
from __future__ import annotations

import argparse

import json
import os

from . import common


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("console", parents=[parent],
                       help="print the URL that opens the web console of the running service, logged in")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..datadir import DataDir
    from ..errors import ServiceNotRunning
    from ..service.http_server import ADDRESS_FILE, TOKEN_ENV, login_url
    cfg = common.load_config(args.config)
    dd = DataDir(args.data_dir or cfg.service.data_dir)
    try:  # written by serve once it listens (mode 0700 run dir): where, and whether it wants a token
        with open(os.path.join(dd.run_dir, ADDRESS_FILE)) as f:
            where = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise ServiceNotRunning(f"no console is listening for {dd.path}: start `shardq serve --data-dir "
                                f"{dd.path}` (with [http] listen set)") from None
    token = None
    if where.get("auth") == "token":
        token = cfg.http.token or os.environ.get(TOKEN_ENV) or dd.http_token()
    print(login_url(where["url"], token))
    return 0
