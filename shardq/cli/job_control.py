"""``shardq job [show] ID`` and ``shardq job cancel ID``: look a job up, or cancel it."""
from __future__ import annotations

import argparse

import json
from typing import Any

from . import common, exits

_BODY_PREVIEW_BYTES = 1000


def _job_id(text: str) -> int | str:
    """argparse's type: :func:`common.job_id`. Text (another backend's id) is refused on the
    local shards by :func:`run` (:func:`common.check_local_ids`, the same error as argparse's),
    and on a backend's URL a look-up and a cancel are Unsupported, whatever the id: they are
    the local shards' own calls."""
    import argparse
    if text in ("show", "cancel"):  # `shardq job cancel` with the id left out
        raise argparse.ArgumentTypeError(f"{text} needs a job id: shardq job {text} ID")
    return common.job_id(text)


_job_id.__name__ = "job id"


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("job", parents=[parent], help="show or cancel one job by id (`shardq job ID`: show)")
    # optional, so that `shardq job 5120` is `shardq job show 5120`
    s.add_argument("action", nargs="?", choices=["show", "cancel"], default="show",
                   help="show (the default) or cancel")
    s.add_argument("job_id", type=_job_id)
    common.add_raw_flag(s)
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    common.check_local_ids(args, "job", job_id=args.job_id)
    with common.connect(args) as q, common.naming_a_job(args.job_id):
        if args.action == "show":
            print(json.dumps(show(q, args.job_id, args.raw)))
        else:
            # cancelled | purged | cancelling: done (cancel is idempotent while the job is
            # there); gone: the job does not exist, the one error of every job command
            done = common.control_call(q, "cancel").cancel(args.job_id)
            if done == "gone":
                raise common.no_such_job(args.job_id)
            print(done)
    return exits.OK


def show(q: Any, job_id: int, raw: bool = False) -> dict[str, Any]:
    """What ``job show`` prints: the live job (its body decoded, a task's workflow fields
    included), its progress, and its kept result's size and expiry; for a job acked with
    its result kept, ``state`` ``succeeded`` and the result's figures. NotFound if the job
    is neither live nor has a result kept."""
    from ..client.contracts import Results
    from ..client.results import look_up
    info, outcome = look_up(common.control_call(q, "job").job, q.results if isinstance(q, Results) else None, job_id)
    if info is None:
        info = {"job_id": job_id, "state": "succeeded"}
    else:
        body = info.pop("body")
        info.update(common.body_fields(body, raw, _BODY_PREVIEW_BYTES))
        info["body_bytes"] = len(body)
    if outcome is not None:
        info.update(progress=outcome.fraction, note=outcome.note)
        if outcome.state == "succeeded":
            info.update(result_bytes=len(outcome.value or b""), result_expires_at=outcome.expires_at)
    return info
