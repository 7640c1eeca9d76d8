"""``shardq console``: print the URL that opens the running service's web console logged in
(``http://127.0.0.1:7781/login?token=...``), read from the listener's address file and the
token from where that file says serve took it (``token_from``): the config's ``[http]
token``, ``SHARDQ_HTTP_TOKEN`` in serve's environment, or ``<data dir>/http-token``, which
serve made. A token this command cannot know (serve's environment is not this shell's) is
a UsageError saying where to get it, never a URL with another token that fails to log in."""
from __future__ import annotations

import argparse

import json
import os
from typing import Any

from ..config import Config
from ..datadir import DataDir
from . import common


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("console", parents=[parent],
                       help="print the URL that opens the web console of the running service, logged in")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ServiceNotRunning
    from ..service.http_server import ADDRESS_FILE, login_url
    cfg = common.load_config(args.config)
    dd = DataDir(common.service_dir(args))
    try:  # written by serve once it listens (mode 0700 run dir): where, and whether it wants a token
        with open(os.path.join(dd.run_dir, ADDRESS_FILE)) as f:
            where = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise ServiceNotRunning(f"no console is listening for {dd.path}: start `shardq serve --data-dir "
                                f"{dd.path}` (with [http] listen set)") from None
    token = _token(where, cfg, dd, args.config) if where.get("auth") == "token" else None
    print(login_url(where["url"], token))
    return 0


def _token(where: dict[str, Any], cfg: Config, dd: DataDir, config_flag: str | None) -> str:
    """The token of the serve that wrote ``where`` (its address file), from where it took it."""
    from ..errors import UsageError
    from ..service.http_server import TOKEN_ENV, TOKEN_FROM_CONFIG, TOKEN_FROM_ENV, TOKEN_FROM_FILE
    source = where.get("token_from")
    serve = f"shardq serve on {dd.path} (pid {where.get('pid', '?')})"
    if source == TOKEN_FROM_FILE:
        return dd.http_token()
    if source == TOKEN_FROM_ENV:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise UsageError(f"{serve} takes the console's token from {TOKEN_ENV} in its environment (e.g. "
                             f"/etc/shardq/env under systemd), and this shell has no {TOKEN_ENV}: set it to "
                             f"serve's value and run shardq console again")
        return token
    if source == TOKEN_FROM_CONFIG:
        if not cfg.http.token:
            raise UsageError(f"{serve} takes the console's token from its config's http.token, and this "
                             f"command's config ({common.config_source(config_flag)}) sets none: give "
                             "shardq console serve's --config")
        return cfg.http.token
    # an address file that does not say (an older serve's, or a listener given its token by its
    # caller): the first token there is, as before
    return cfg.http.token or os.environ.get(TOKEN_ENV) or dd.http_token()
