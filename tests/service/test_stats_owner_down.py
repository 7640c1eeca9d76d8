"""A limited queue whose owner shard is down, and which no other shard holds, is still listed
(docs/limits.md "Seeing the limits"): ``stats()``, ``shardq stats`` and ``--json``, and the
console's ``/api/overview`` show it with ``{"owner": N, "owner_down": true}`` and no figures.
It was missing from all of them: the totals learnt that a queue is limited only from a shard
holding it, and the up shard held nothing of it; now each shard's ``stats`` reply names the
queues its config declares with limits (``placed``)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from support.http_calls import api
from support.service import REPO, Service

from shardq.config import owner_shard

TOKEN = "owner-down-console-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = {"http": {"listen": "127.0.0.1:0", "token": TOKEN},
          "service": {"health_timeout": 120},  # the stopped shard stays down (not restarted as hung)
          "queues": {"default": {}, "lim": {"concurrency": 2, "rate": "1000/s"},
                     "quiet": {"concurrency": 1}, "unused": {"rate": "5/s"}}}
DOWN = {"owner": 1, "owner_down": True}


def cli(svc, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args, "--data-dir", svc.data_dir],
                          capture_output=True, timeout=60, env=env, cwd=os.path.dirname(svc.data_dir))


def test_a_limited_queue_stays_listed_while_its_owner_shard_is_down():
    assert (owner_shard("lim", 2), owner_shard("quiet", 2), owner_shard("unused", 2)) == (1, 0, 1)
    with Service(shards=2, config=CONFIG) as svc, svc.connect(retry_s=0.5, request_timeout_s=1) as q:
        url = svc.http_url()
        q.enqueue(b"charge", key="customer-1", queue="lim")
        assert len(q.dequeue_many("lim", max_jobs=1, wait=5)) == 1
        up = q.stats()["queues"]
        assert up["lim"]["in_flight"] == 1 and up["lim"]["limits"]["owner"] == 1
        assert "quiet" not in up and "unused" not in up  # limited, held nowhere, owners up: not listed, as before
        owner = svc.shard_pids()[1]
        os.kill(owner, signal.SIGSTOP)
        try:
            st = q.stats()
            assert [sh["available"] for sh in st["shards"]] == [True, False]
            assert st["queues"]["lim"]["limits"] == DOWN
            assert st["queues"]["lim"]["ready"] == 0  # summed over the shards that answered
            assert "quiet" not in st["queues"]  # its owner (shard 0) answered: it holds nothing
            assert st["queues"]["unused"]["limits"] == DOWN  # what its owner holds is not known

            r = cli(svc, "stats", "--json")
            assert r.returncode == 1, r.stderr  # a shard is down
            assert json.loads(r.stdout)["queues"]["lim"]["limits"] == DOWN
            r = cli(svc, "stats")
            row = [line for line in r.stdout.decode().splitlines() if line.startswith("lim ")]
            assert len(row) == 1 and row[0].endswith("owner shard 1 down: figures not known"), r.stdout

            status, overview = api(url, "/api/overview", headers=BEARER)
            assert status == 200
            rows = {row["name"]: row for row in overview["queues"]}
            assert rows["lim"]["limits"] == DOWN and rows["lim"]["ready"] == 0
            assert "quiet" not in rows and rows["unused"]["limits"] == DOWN
        finally:
            with contextlib.suppress(ProcessLookupError):  # the supervisor may have ended it (hung)
                os.kill(owner, signal.SIGCONT)
