"""``shardq serve``: run the shard supervisor in the foreground, and its HTTP listener
(metrics and web console; ``[http] listen``, on by default on loopback).

Under a service manager (``NOTIFY_SOCKET``, systemd's ``Type=notify``) it speaks sd_notify
(:mod:`shardq.service.notify`). SIGTERM/SIGINT stop it cleanly (exit 0 within
``STOP_GRACE_S`` + 5 s); SIGHUP reloads the config file (docs/operations.md, "Signals")."""
from __future__ import annotations

import logging
import sys

from . import common

log = logging.getLogger("shardq.supervisor")


def register(sub, parent) -> None:
    s = sub.add_parser("serve", parents=[parent], help="run the shard supervisor (the service)")
    s.add_argument("--shards", type=int, help="number of shards (default: config; 0 = one per two CPUs)")
    s.set_defaults(fn=run)


def run(args) -> int:
    from ..service.notify import Notifier
    from ..service.supervisor import Supervisor
    cfg = common.load_config(args.config)
    log.info("event=config source=%s", common.config_source(args.config))
    sup = Supervisor(args.data_dir or cfg.service.data_dir, cfg, args.shards, notifier=Notifier())
    http = None
    if cfg.http.listen:
        from ..service.http_server import HttpService, resolve_token
        resolve_token(cfg.http)  # a bad token is refused before any shard starts
    # before anything starts: a signal meanwhile is a clean stop (a SIGHUP waits for run())
    sup.handle_signals(reload=lambda: _reread(args.config))
    sup.start()
    sqs = None
    try:
        if cfg.http.listen:
            http = HttpService(sup.dd.path, cfg.http, sup).start(sup.dd.run_dir)
        if cfg.sqs_api.listen:  # the SQS API (shardq/sqs_api/), bound before READY like the console
            from ..sqs_api.server import SqsService
            sqs = SqsService(sup.dd.path, cfg.sqs_api).start(sup.dd.run_dir)
    except BaseException:
        if http is not None:
            http.stop()
        sup.stop()
        raise
    # The console's URL with its login (the token, as Jupyter prints it), so opening it stays
    # one step; on stderr of the user who started the service, never in the shards' logs.
    print(f"shardq serving {sup.dd.path} with {len(sup.handles)} shards; sockets in {sup.dd.run_dir}"
          + (f"; metrics at {http.url}metrics; console at {http.login_url}" if http else "")
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


def _reread(path: str | None):
    """The config again, for SIGHUP, found as at start: ``--config``, else
    config/shardq.toml if it is there now, else the built-in defaults."""
    log.info("event=reload source=%s", common.config_source(path))
    return common.load_config(path)
