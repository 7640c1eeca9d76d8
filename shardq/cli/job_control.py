"""``shardq job show|cancel ID``: look a job up, or cancel it."""
from __future__ import annotations

import json

from . import common, exits

_BODY_PREVIEW_BYTES = 1000


def register(sub, parent) -> None:
    s = sub.add_parser("job", parents=[parent], help="show or cancel one job by id")
    s.add_argument("action", choices=["show", "cancel"])
    s.add_argument("job_id", type=int)
    common.add_raw_flag(s)
    s.set_defaults(fn=run)


def run(args) -> int:
    with common.connect(args) as q:
        if args.action == "show":
            info = common.control_call(q, "job")(args.job_id)
            body = info.pop("body")
            info.update(common.body_fields(body, args.raw, _BODY_PREVIEW_BYTES))
            info["body_bytes"] = len(body)
            print(json.dumps(info))
        else:
            # cancelled | purged | cancelling | gone: each is success (cancel is idempotent)
            print(common.control_call(q, "cancel")(args.job_id))
    return exits.OK
