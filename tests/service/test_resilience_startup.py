"""A shard that cannot start does not stop the service (issue 15 item 4), and what an
operator reads about it (issue 15 item 7).

* A corrupt log found at startup leaves that shard down ("failed", not retried) while the
  others serve; ``stats`` (CLI table and JSON) and the metrics show it with the file and
  the offset; the log says so at ERROR. Before: ``serve`` exited 1 and nothing served.
* With every shard failed there is nothing to serve: ``serve`` exits 1 with each reason
  in words (before: a Python dict in the message).
* The log: the config file it loaded, replay once per shard start (before: also in the
  shard's ``ready`` line), shard exits at WARNING, a second SIGTERM says what it does.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from support.service import REPO, Service, wait_until
from shardq.client.router import shard_for_key
from shardq.wal.format import HEADER, HEADER_BYTES, MAGIC_BYTES

ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def key_on(shard: int, shards: int = 2) -> str:
    return next(k for k in (f"k{i}" for i in range(1000)) if shard_for_key(k, shards) == shard)


def corrupt_a_middle_record(shard_dir: str) -> tuple[str, int]:
    """Flip a payload byte of the 3rd record of the newest segment; (path, record offset)."""
    seg = sorted(n for n in os.listdir(shard_dir) if n.endswith(".wal"))[-1]
    path = os.path.join(shard_dir, seg)
    with open(path, "r+b") as f:
        data = f.read()
        offsets, off = [], MAGIC_BYTES  # the magic, then records (shardq/wal/format.py)
        while off + HEADER_BYTES <= len(data) and (length := HEADER.unpack_from(data, off)[1]):
            offsets.append(off)
            off += HEADER_BYTES + length
        assert len(offsets) >= 5, offsets
        f.seek(offsets[2] + HEADER_BYTES + 2)
        f.write(bytes([data[offsets[2] + HEADER_BYTES + 2] ^ 0xFF]))
    return path, offsets[2]


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=ENV)


def test_a_corrupt_log_at_startup_leaves_that_shard_failed_and_the_others_serving():
    with Service(shards=2) as svc:
        with svc.connect() as q:
            for i in range(6):
                q.enqueue(f"zero {i}".encode(), key=key_on(0))
            other = q.enqueue(b"one", key=key_on(1))
        assert svc.stop() == 0
        path, offset = corrupt_a_middle_record(os.path.join(svc.data_dir, "shard-0"))
        svc.log.close()
        svc.wait_for = [1]
        svc.start()
        url = svc.http_url()
        with svc.connect(retry_s=0.5) as q:
            wait_until(lambda: q.stats()["shards"][0].get("status") == "failed", 10, 0.05, "shard 0 failed")
            assert q.dequeue().job_id == other  # the other shard serves

        st = json.loads(cli("stats", "--json", "--data-dir", svc.data_dir).stdout)["shards"][0]
        assert (st["available"], st["status"], st["reason_kind"]) == (False, "failed", "corrupt_log"), st
        assert f"corrupt log {path} at offset {offset}: " in st["reason"], st
        table = cli("stats", "--data-dir", svc.data_dir)
        assert table.returncode == 1
        assert re.search(rf"^0 +DOWN  failed: corrupt log {re.escape(path)} at offset {offset}: ", table.stdout,
                         re.M), table.stdout

        m = metrics(url)
        assert m[("shardq_shard_up", (("shard", "0"),))] == 0 and m[("shardq_shard_up", (("shard", "1"),))] == 1
        assert m[("shardq_shard_failed", (("shard", "0"),))] == 1
        assert m[("shardq_shard_status", (("reason", "corrupt_log"), ("shard", "0"), ("status", "failed")))] == 1
        assert m[("shardq_shard_status", (("reason", ""), ("shard", "1"), ("status", "ready")))] == 1

        log = svc.tail(200)
        assert re.search(rf"ERROR event=shard-failed shard=0 reason=\"corrupt log {re.escape(path)} at offset "
                         rf"{offset}: ", log), log
        assert "ERROR event=shard-down shard=0 status=failed" in log and "event=ready shards=2 down=1" in log
        assert "{'path'" not in log
        assert svc.stop() == 0


def test_with_every_shard_failed_serve_exits_1_naming_each_reason_in_words():
    with Service(shards=1) as svc:
        with svc.connect() as q:
            for i in range(6):
                q.enqueue(f"job {i}".encode())
        assert svc.stop() == 0
        path, offset = corrupt_a_middle_record(os.path.join(svc.data_dir, "shard-0"))
        # Any free port: serve binds its listener before the shards start, and the repo's
        # config (read from the working directory) names 7781, which another serve may hold.
        r = subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--data-dir", svc.data_dir, "--shards", "1",
                            "--http-listen", "127.0.0.1:0"],
                           capture_output=True, text=True, timeout=60, env=ENV, stdin=subprocess.DEVNULL)
        assert r.returncode == 1, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ShardUnavailable: no shard could start: shard 0: corrupt log "
                               f"{path} at offset {offset}: "), last
        assert "{" not in last


def test_the_log_names_the_config_replays_once_warns_on_exits_and_speaks_on_a_second_sigterm():
    with Service(shards=2) as svc:
        cfg_path = svc.data_dir.rstrip("/") + ".toml"
        pids = svc.shard_pids()
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: svc.tail(200).count("event=shard-ready shard=0") >= 2, 20, 0.05, "shard 0 back")
        log = svc.tail(200)
        assert f"INFO event=config source={cfg_path}" in log
        for pid in (pids[1],):  # one start of one shard: its replay is logged once
            own = [line for line in log.splitlines() if f"pid={pid} " in line and "shard-1 " in line]
            assert sum("replayed" in line for line in own) == 1, own
        assert re.search(rf"WARNING event=shard-exit shard=0 pid={pids[0]} exit=signal=SIGKILL", log), log

        os.kill(svc.shard_pids()[1], signal.SIGSTOP)  # the first SIGTERM's clean stop waits for it
        svc.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "event=stopping" in svc.tail(), 10, 0.05, "the first SIGTERM taken")
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(10) == 1
        assert re.search(r"WARNING event=killed signal=SIGTERM note=\"second signal: shards SIGKILLed",
                         svc.tail()), svc.tail()
