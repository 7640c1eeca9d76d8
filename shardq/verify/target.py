"""``shardq verify --target``: the chaos run against a backend that is not a local service.

The same producers, workers and history checker; the queue ``default`` of the target is
created (``shardq sqs init``) with the run's visibility timeout and ``max_deliveries`` (at
most SQS's 1000: still out of reach of a run) and must be empty. Faults: worker SIGKILLs
and SIGSTOPs only; the backend's servers are not ours to kill.

Workers lease one job per request by default (``--worker-batch 1``). With bigger batches a
killed worker can leave several jobs of one key in flight at once (the SQS backend buffers
them, handing out one); they time out together, and moto (the test server) redelivers such a
batch out of order, which the checker reports as an order violation of the server. That moto
bug has its own strict-xfail test (tests/consumer/test_contract.py); ``--worker-batch 4`` shows it.
"""
from __future__ import annotations

import argparse
import math
from contextlib import closing


def prepare(a: argparse.Namespace) -> str | None:
    """Create the target's queue for the run; a reason it cannot be used, or None."""
    from ..backends import for_target
    from ..config import parse
    from ..errors import ShardqError
    if for_target(a.target) is None:
        return "not a backend target (expected sqs://<region>/<prefix>)"
    from ..backends.sqs_admin import init
    from ..backends.sqs_client import Api
    from ..backends.sqs_mapping import parse_target
    try:
        config = parse({"queues": {"default": {"visibility_timeout": float(math.ceil(a.visibility)),
                                               "max_deliveries": min(a.max_deliveries, 1000),
                                               "max_body_bytes": 1024 * 1024}}})
        for line in init(Api(parse_target(a.target)), config):
            print(f"sqs init: {line}", flush=True)
        import shardq
        with closing(shardq.connect(a.target)) as q:
            counts = q.stats()["queues"].get("default", {})
    except ShardqError as e:
        return f"{type(e).__name__}: {e}"
    if any(counts.get(k, 0) for k in ("ready", "delayed", "in_flight", "dead")):
        return f"queue 'default' is not empty ({counts}); verify needs a fresh prefix"
    return None
