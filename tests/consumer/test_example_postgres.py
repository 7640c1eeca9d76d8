"""examples/postgres_app runs end to end against a real PostgreSQL and a real ``shardq
serve``: every placed order gets exactly one receipt, a declined one none."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from support.service import REPO, Service, wait_until

pytest.importorskip("psycopg")


def _app(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "examples.postgres_app.app", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_orders_get_exactly_one_receipt_each(pg, pg_dsn, tmp_path):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    url = pg.url(pg_dsn.rsplit("dbname=", 1)[1])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with Service(shards=2) as svc:
        assert _app("setup", "--dsn", url) == {"ok": True}
        log = open(tmp_path / "procs.log", "ab")
        procs = [subprocess.Popen([sys.executable, "-m", "shardq.cli", *args, "--connect", svc.data_dir],
                                  cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
                 for args in (["outbox", "relay", "--dsn", url],
                              ["worker", "examples.postgres_app.app:handle", "--idempotency", url])]
        try:
            placed = _app("orders", "60", "--dsn", url)
            assert placed["placed"] + placed["declined"] == 60 and placed["declined"] > 0
            wait_until(lambda: _app("report", "--dsn", url)["receipts"] >= placed["placed"], 60, 0.1,
                       "a receipt for every order")
            for p in procs:
                p.send_signal(signal.SIGTERM)
            assert [p.wait(30) for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            log.close()
    assert _app("report", "--dsn", url) == {"orders": placed["placed"], "receipts": placed["placed"],
                                            "orders_without_receipt": 0}
