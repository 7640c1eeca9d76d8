"""``shardq serve``: run the shard supervisor in the foreground, and its HTTP listener
(metrics and web console; ``[http] listen``, on by default on loopback).

The listener's address is, first to last: ``--http-listen``, ``SHARDQ_HTTP_LISTEN``, the
config's ``[http] listen``; ``""`` turns it off. It is bound once the data dir is checked
and locked, before any shard starts: a port that is taken stops ``serve`` at once (exit 5,
naming the port, the process holding it when psutil can tell, and the flag), never after
it has said it is ready.

Under a service manager (``NOTIFY_SOCKET``, systemd's ``Type=notify``) it speaks sd_notify
(:mod:`shardq.service.notify`). SIGTERM/SIGINT stop it cleanly (exit 0 within
``STOP_GRACE_S`` + 5 s); SIGHUP reloads the config file (docs/operations.md, "Signals")."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Mapping

from typing import TYPE_CHECKING

from ..config import Config, split_listen
from ..errors import InvalidConfig
from . import common

if TYPE_CHECKING:
    from ..service.http_server import HttpService
    from ..sqs_api.processes import SqsProcesses
    from ..sqs_api.server import SqsService

log = logging.getLogger("shardq.supervisor")


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("serve", parents=[parent], help="run the shard supervisor (the service)")
    s.add_argument("--shards", type=int, help="number of shards (default: config; 0 = one per two CPUs)")
    s.add_argument("--http-listen", type=_listen_arg, metavar="HOST:PORT",
                   help='where the metrics and console listen, over [http] listen and SHARDQ_HTTP_LISTEN '
                        '(port 0: any free port; "" turns the listener off)')
    s.set_defaults(fn=run)


def _listen_arg(text: str) -> str:
    if text:
        try:
            split_listen(text, "--http-listen")
        except InvalidConfig as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def with_listen(cfg: Config, flag: str | None, env: Mapping[str, str] = os.environ) -> Config:
    """``cfg`` with the listen address of ``--http-listen`` (``flag``), else of
    ``SHARDQ_HTTP_LISTEN``, when either is given (``""``: off)."""
    from ..service.http_server import LISTEN_ENV
    listen, where = (flag, "--http-listen") if flag is not None else (env.get(LISTEN_ENV), LISTEN_ENV)
    if listen is None:
        return cfg
    if listen:
        split_listen(listen, where)  # InvalidConfig naming where the bad value came from
    return dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, listen=listen))


def run(args: argparse.Namespace) -> int:
    from ..service.notify import Notifier
    from ..service.supervisor import Supervisor
    cfg = with_listen(common.load_config(args.config), args.http_listen)
    common.local_only(args.data_dir or cfg.service.data_dir, "serve")  # the local shards' service
    log.info("event=config source=%s", common.config_source(args.config))
    common.check_dir_arg(args.data_dir or cfg.service.data_dir,
                         "--data-dir" if args.data_dir else "service.data_dir (the config's)", create=True)
    sup = Supervisor(args.data_dir or cfg.service.data_dir, cfg, args.shards, notifier=Notifier())
    http = None
    socks: list[socket.socket] = []  # the listeners', bound once the data dir is locked, before any shard starts
    if cfg.http.listen:
        from ..service.http_server import HttpService, bind_listen, resolve_token
        resolve_token(cfg.http)  # a bad token is refused before any shard starts

    def bind() -> None:  # the listeners' ports; one that is taken stops serve, naming it and its key
        if cfg.http.listen:
            socks.append(bind_listen(cfg.http.listen))
        if cfg.sqs_api.listen:
            from ..sqs_api.server import bind_sqs_listen
            socks.append(bind_sqs_listen(cfg.sqs_api.listen))
    # before anything starts: a signal meanwhile is a clean stop (a SIGHUP waits for run())
    sup.handle_signals(reload=lambda: _reread(args.config, args.http_listen))
    sqs: SqsService | SqsProcesses | None = None
    try:
        sup.start(before_shards=bind if (cfg.http.listen or cfg.sqs_api.listen) else None)
        if cfg.http.listen:
            http = HttpService(sup.dd.path, cfg.http, sup).start(sup.dd.run_dir, socks.pop(0))
        if cfg.sqs_api.listen and cfg.sqs_api.processes > 1:  # processes of their own, sharing the socket
            from ..sqs_api.processes import SqsProcesses
            sqs = SqsProcesses(sup.dd.path, cfg.sqs_api, busy_poll_us=cfg.service.busy_poll_us).start(
                sup.dd.run_dir, socks.pop(0))
        elif cfg.sqs_api.listen:  # the SQS API (shardq/sqs_api/), bound before any shard starts, like the console
            from ..sqs_api.server import SqsService, tune_gc
            sqs = SqsService(sup.dd.path, cfg.sqs_api, busy_poll_us=cfg.service.busy_poll_us).start(
                sup.dd.run_dir, socks.pop(0))
            tune_gc()  # this process answers SQS requests now (a listener child tunes its own)
    except BaseException:
        for sock in socks:  # bound, not yet served
            sock.close()
        if http is not None:
            http.stop()
        sup.stop()
        raise
    print(f"shardq serving {sup.dd.path} with {len(sup.handles)} shards; sockets in {sup.dd.run_dir}"
          + (f"; metrics at {http.url}metrics; console at {_console_at(http)}" if http else "")
          + (f"; SQS API at {sqs.url}" if sqs else ""),
          file=sys.stderr, flush=True)
    sup.announce_ready()
    try:
        return sup.run()
    finally:
        if sqs is not None:
            sqs.stop()
        if http is not None:
            http.stop()


def _console_at(http: HttpService) -> str:
    """The console for serve's startup line: the URL with its login (the token, as Jupyter
    prints it) when serve made the token, so opening it stays one step; on stderr of the
    user who started the service, never in the shards' logs. A token serve was given (its
    config's, its environment's) is not copied there: a journal keeps the line on disk, for
    readers that /etc/shardq/env or the config keep out. The line says where the token is."""
    from ..service.http_server import TOKEN_ENV, TOKEN_FROM_CONFIG, TOKEN_FROM_ENV
    given = {TOKEN_FROM_ENV: f"{TOKEN_ENV} of serve's environment", TOKEN_FROM_CONFIG: "http.token of serve's config"}
    if http.token_from in given:
        return f"{http.url} (log in with {given[http.token_from]}; `shardq console` prints the URL that does)"
    return http.login_url


def _reread(path: str | None, listen: str | None) -> Config:
    """The config again, for SIGHUP, found as at start: ``--config``, else
    config/shardq.toml if it is there now, else the built-in defaults; with the listen
    address of the command line or the environment, as at start."""
    log.info("event=reload source=%s", common.config_source(path))
    return with_listen(common.load_config(path), listen)
