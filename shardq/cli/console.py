"""``shardq console``: print the URL that opens the running service's web console logged in
(``http://127.0.0.1:7781/login?token=...``), read from the listener's address file and the
token from where that file says serve took it (``token_from``): the config's ``[http]
token``, ``SHARDQ_HTTP_TOKEN`` in serve's environment, or ``<data dir>/http-token``, which
serve made. A token this command cannot know (serve's environment is not this shell's) is
a UsageError saying where to get it, never a URL with another token that fails to log in.

Before it prints the URL it asks the running console once whether the token is serve's
(``GET /api/session`` with it as the bearer token, :data:`CHECK_TIMEOUT_S`): refused (401,
403; e.g. this shell's ``SHARDQ_HTTP_TOKEN`` is not serve's) is a UsageError, exit 2, naming
where the token came from, and no URL. A console that does not answer (not reachable from
here, too slow, another status) leaves the token unchecked: the URL is printed, exit 0, as
before, with a note on stderr saying it was not checked."""
from __future__ import annotations

import argparse

import json
import os
from typing import Any

from ..config import Config
from ..datadir import DataDir
from . import common

#: seconds the token check waits for the console's answer
CHECK_TIMEOUT_S = 3.0


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("console", parents=[parent],
                       help="print the URL that opens the web console of the running service, logged in")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ServiceNotRunning
    from ..service.http_server import ADDRESS_FILE, login_url
    cfg = common.load_config(args.config)
    dd = DataDir(common.local_service_dir(args, "console"))
    try:  # written by serve once it listens (mode 0700 run dir): where, and whether it wants a token
        with open(os.path.join(dd.run_dir, ADDRESS_FILE)) as f:
            where = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise ServiceNotRunning(f"no console is listening for {dd.path}: start `shardq serve --data-dir "
                                f"{dd.path}` (with [http] listen set)") from None
    token = _token(where, cfg, dd, args.config) if where.get("auth") == "token" else None
    if token is not None:
        _check(where, token, dd)
    print(login_url(where["url"], token))
    return 0


def _check(where: dict[str, Any], token: str, dd: DataDir) -> None:
    """Ask the console whether ``token`` is serve's (one bearer-authenticated GET of
    ``/api/session``): UsageError when it refuses it; a note on stderr when it cannot tell."""
    import sys
    import urllib.error
    import urllib.request

    from ..errors import UsageError
    from ..service.http_server import TOKEN_ENV, TOKEN_FROM_CONFIG, TOKEN_FROM_ENV, TOKEN_FROM_FILE
    url = f"{where['url']}api/session"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy: loopback
    try:
        with opener.open(request, timeout=CHECK_TIMEOUT_S):
            return
    except urllib.error.HTTPError as e:
        status = e.code
        e.close()
    except (OSError, ValueError) as e:  # refused, timed out, no route; a URL it cannot read
        print(f"note: the console at {where['url']} did not answer ({common.shown(e, backslash=False)}): "
              "the token in this URL is not checked", file=sys.stderr)
        return
    if status not in (401, 403):
        print(f"note: the console at {where['url']} answered HTTP {status} to the token check: the token in "
              "this URL is not checked", file=sys.stderr)
        return
    source = str(where.get("token_from"))
    taken, fix = {
        TOKEN_FROM_ENV: (f"{TOKEN_ENV} of this shell", f"set {TOKEN_ENV} to serve's value (e.g. /etc/shardq/env "
                                                      "under systemd)"),
        TOKEN_FROM_CONFIG: ("http.token of this command's config", "give shardq console serve's --config"),
        TOKEN_FROM_FILE: (f"{dd.path}/http-token", "run shardq console as the user and with the data dir of serve"),
    }.get(source, ("the config's http.token, SHARDQ_HTTP_TOKEN or the data dir's http-token",
                   "give shardq console serve's --config and environment"))
    raise UsageError(f"the console at {where['url']} refused the token from {taken} (HTTP {status}): it is not "
                     f"the token shardq serve on {dd.path} (pid {where.get('pid', '?')}) uses; {fix}, and run "
                     "shardq console again")


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
