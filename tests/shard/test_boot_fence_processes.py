"""A placed queue's lease leaves before its fsync, and a power cut cannot push its cap over
(docs/limits.md, "Across restarts"), with real ``shardq serve`` processes.

A power cut is what ``shardq verify --power-cuts`` makes of one: every process SIGKILLed,
then the writes after the last fsync taken from the newest segment, and the kernel's boot
id no longer the one the shard's boot record names. Here the lost writes are exactly the
leases (zeroed from where the log ended before them), so the restarted shard knows nothing
of two jobs that their holders may still be running."""
from __future__ import annotations

import json
import os
import time

import jsonschema
import pytest

import shardq
from shardq.config import owner_shard
from shardq.service.console import openapi
from shardq.datadir import DataDir
from shardq.shard.boot_fence import BOOT_RECORD
from shardq.verify.powercut import newest_segment, reboot
from shardq.wal.format import SEGMENT
from shardq.wal.reader import FileScan

from support import browser
from support.http_calls import api, request
from support.service import Service, wait_until

VIS = 2.0
CONFIG = {"queues": {"capped": {"concurrency": 2, "visibility_timeout": VIS}, "plain": {},
                     "long": {"concurrency": 2, "visibility_timeout": 3600}}}


def _limits(q, queue: str) -> dict:
    return q.stats()["shards"][owner_shard(queue, q.shards)]["queues"][queue]["limits"]


def _records_end(path: str) -> int:
    with open(path, "rb") as f:
        data = f.read()
    scan = FileScan(path, data, SEGMENT, tail_may_tear=True)
    for _ in scan:
        pass
    return scan.valid_end


def _power_cut(svc: Service, shard_dir: str, segment: str, lost_from: int) -> None:
    svc.kill_all()
    size = os.path.getsize(segment)
    with open(segment, "r+b") as f:   # what was written after lost_from never reached the disk
        f.seek(lost_from)
        f.write(bytes(size - lost_from))
    with open(os.path.join(shard_dir, BOOT_RECORD)) as f:
        assert json.load(f)["clean"] is False
    assert reboot(svc.data_dir) == 1


TOKEN = "boot-fence-console-token-0123456789"
WHY = browser.missing()


def test_after_a_power_cut_placed_queues_lease_nothing_until_lost_leases_ran_out():
    cfg = dict(CONFIG, http={"listen": "127.0.0.1:0", "token": TOKEN})
    with Service(shards=1, config=cfg) as svc:
        shard_dir = DataDir(svc.data_dir).shard_dir(0)
        with svc.connect() as q:
            q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(4)], queue="capped")
            q.enqueue(b"p", queue="plain")
            segment = newest_segment(shard_dir)
            lost_from = _records_end(segment)
            held = q.dequeue_many("capped", max_jobs=4)
            assert len(held) == 2
        _power_cut(svc, shard_dir, segment, lost_from)
        restart = time.time()
        svc.start()
        with svc.connect() as q:
            fig = _limits(q, "capped")
            assert fig["in_flight"] == 0 and fig["held_back"] == 4      # the leases were lost
            # the fence: the longest early visibility of the last run (the "long" queue's), from
            # the restart; the holders of the lost leases may be running till their deadlines
            assert restart + 3600 <= fig["fenced_until"] <= time.time() + 3600
            assert q.dequeue("capped", wait=0.3) is None
            assert q.dequeue("plain").body == b"p"                      # other queues are not held
        assert "the machine restarted since its last run" in svc.tail(200)
        _seen_in_metrics_api_and_console(svc, fig["fenced_until"])


def _seen_in_metrics_api_and_console(svc: Service, fenced_until: float) -> None:
    url = svc.http_url()
    status, _, body = request(url, "/metrics")
    assert status == 200
    line = next(ln for ln in body.decode().splitlines()
                if ln.startswith("shardq_queue_limit_fenced_until{") and 'queue="capped"' in ln)
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(fenced_until)
    status, overview = api(url, "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    doc = openapi.document()
    jsonschema.validate(overview, {"$ref": "#/components/schemas/Overview", "components": doc["components"]})
    row = {r["name"]: r for r in overview["queues"]}["capped"]
    assert row["limits"]["fenced_until"] == pytest.approx(fenced_until)
    if WHY is not None:  # CI installs Chromium (.ci/setup-system); a bare machine may not have it
        return
    with browser.chromium() as d:
        d.get(f"{url}login?token={TOKEN}")
        wait_until(lambda: d.execute_script("return document.body.dataset.ready") == "1", 20, 0.05, "the console")
        badge = 'tr[data-queue="capped"] td.limits .badge.fenced'
        wait_until(lambda: d.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", badge)
            is not None, 10, 0.05, "the fence shown")
        assert d.execute_script("return document.querySelector(arguments[0]).textContent;",
                                badge).startswith("fenced until ")


def test_the_fence_ends_and_the_slots_come_back_after_it():
    cfg = {"queues": {"capped": {"concurrency": 2, "visibility_timeout": VIS}}}
    with Service(shards=1, config=cfg) as svc:
        shard_dir = DataDir(svc.data_dir).shard_dir(0)
        with svc.connect() as q:
            q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(4)], queue="capped")
            segment = newest_segment(shard_dir)
            lost_from = _records_end(segment)
            held = q.dequeue_many("capped", max_jobs=4)
        _power_cut(svc, shard_dir, segment, lost_from)
        svc.start()
        with svc.connect() as q:
            fence = _limits(q, "capped")["fenced_until"]
            got = q.dequeue_many("capped", max_jobs=4, wait=VIS + 5)   # woken when the fence ends
            assert len(got) == 2
            started = got[0].deadline - VIS                               # the shard's clock
            assert started >= fence > max(h.deadline for h in held)       # the lost ones had run out
            assert "fenced_until" not in _limits(q, "capped")
            for h in held:
                try:
                    q.ack(h)
                except shardq.LeaseLost:
                    pass
                else:
                    raise AssertionError("a lease the power cut took was acked")
            q.ack_many(got)


def test_a_sigkill_or_a_clean_stop_before_a_reboot_fences_nothing():
    with Service(shards=1, config=CONFIG) as svc:
        shard_dir = DataDir(svc.data_dir).shard_dir(0)
        with svc.connect() as q:
            q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(4)], queue="capped")
            held = q.dequeue_many("capped", max_jobs=4)
        svc.kill_all()                       # the same boot: the kernel kept every write
        svc.start()
        with svc.connect() as q:
            fig = _limits(q, "capped")
            assert fig["in_flight"] == 2 and "fenced_until" not in fig     # replayed, not fenced
            q.ack_many(held)
        svc.stop()
        path = os.path.join(shard_dir, BOOT_RECORD)
        rec = json.load(open(path))
        assert rec["clean"] is True
        rec["boot_id"] = "the-boot-before-a-clean-reboot"
        json.dump(rec, open(path, "w"))
        svc.start()
        with svc.connect() as q:
            assert "fenced_until" not in _limits(q, "capped")
            assert len(q.dequeue_many("capped", max_jobs=4)) == 2


def test_a_placed_lease_goes_before_its_fsync_unless_it_outlasts_the_boot_record():
    """One fsync per leased and acked job on a placed queue, as on any batched queue (the
    ack's covers the lease); a lease longer than any visibility the boot record covers waits
    for its own."""
    with Service(shards=1, config=CONFIG) as svc:
        with svc.connect() as q:
            def fsyncs():
                return q.shard_metrics()[0]["fsyncs"]
            for visibility, least, most in ((None, 0, 1.2), (3601, 1.9, 9)):
                q.enqueue_many([{"body": b"x"} for _ in range(40)], queue="long")
                before = fsyncs()
                for _ in range(40):
                    q.ack(q.dequeue("long", visibility=visibility))
                per_job = (fsyncs() - before) / 40
                assert least <= per_job <= most, (visibility, per_job)
