"""``shardq job show|cancel ID``: look a job up, or cancel it."""
from __future__ import annotations

import json

from . import common, exits

_BODY_PREVIEW_BYTES = 1000


def _job_id(text: str) -> int:
    """argparse's type: the router's check of a job id written as text (one error line)."""
    import argparse

    from ..client.routing import job_id_from_text
    from ..errors import InvalidJob
    try:
        return job_id_from_text(text)
    except InvalidJob as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub, parent) -> None:
    s = sub.add_parser("job", parents=[parent], help="show or cancel one job by id")
    s.add_argument("action", choices=["show", "cancel"])
    s.add_argument("job_id", type=_job_id)
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
