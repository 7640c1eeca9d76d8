"""``shardq serve``: run the shard supervisor in the foreground."""
from __future__ import annotations

import logging
import sys

from . import common

log = logging.getLogger("shardq.supervisor")


def register(sub, parent) -> None:
    s = sub.add_parser("serve", parents=[parent], help="run the shard supervisor (the service)")
    s.add_argument("--shards", type=int, help="number of shards (default: config; 0 = CPUs)")
    s.set_defaults(fn=run)


def run(args) -> int:
    from ..service.supervisor import Supervisor
    cfg = common.load_config(args.config)
    log.info("event=config source=%s", common.config_source(args.config))
    sup = Supervisor(args.data_dir or cfg.service.data_dir, cfg, args.shards)
    sup.start()
    print(f"shardq serving {sup.dd.path} with {len(sup.handles)} shards; sockets in {sup.dd.run_dir}",
          file=sys.stderr, flush=True)
    return sup.run()
