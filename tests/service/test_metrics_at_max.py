"""``/metrics`` of a shard at the documented maximum: ``limits.QUEUES_MAX`` queues with
128-byte names and every limit (docs/limits.md). The one ``metrics`` reply of such a shard
was about 69 MB, over the frame limit: the router refused it and the scrape said
``shardq_shard_up{shard="0"} 0`` with no queue series, and the console showed the shard
down. A scrape now reads it in pages (``metrics_page``: tests/shard/test_metrics_pages.py)."""
from __future__ import annotations

import json
import re
import time

from shardq import limits

from support.http_calls import request
from support.raw_shard import Raw
from support.service import Service

TOKEN = "metrics-at-max-" + "t" * 24
BEARER = {"Authorization": f"Bearer {TOKEN}"}
EVERY_LIMIT = {"concurrency": 10, "rate": "25/s", "burst": 30, "group_separator": "/", "group_concurrency": 2,
               "group_rate": "5/s", "fair": True}


def name(i: int) -> str:
    return f"{i:08d}".ljust(limits.QUEUE_NAME_BYTES_MAX, "q")


def make_queues(svc: Service) -> None:
    """QUEUES_MAX queues of one job each, the fastest way the wire allows: full batches
    (BATCH_JOBS_MAX jobs, a queue each) straight to the shard, each reply read before the
    next batch goes (a shard drops a client that leaves its replies unread for a second). A
    router would ask each new queue's placement first: a round trip per queue."""
    raw = Raw(svc, 0)
    try:
        for start in range(0, limits.QUEUES_MAX, limits.BATCH_JOBS_MAX):
            items = [[b"x", "g/k", name(i), 0, 0, None] for i in range(start, start + limits.BATCH_JOBS_MAX)]
            status, ids = raw.reply(raw.send("enqueue", [items, None]), timeout=120)
            assert status == 0 and len(ids) == limits.BATCH_JOBS_MAX, (status, str(ids)[:200])
    finally:
        raw.close()


def test_metrics_of_a_shard_at_queues_max_with_every_limit_has_the_shard_up_and_every_queue():
    config = {"http": {"listen": "127.0.0.1:0", "token": TOKEN}, "queue_defaults": EVERY_LIMIT}
    with Service(shards=1, config=config) as svc:
        t0 = time.monotonic()
        make_queues(svc)
        made_s = time.monotonic() - t0
        t0 = time.monotonic()
        status, _, data = request(svc.http_url(), "/metrics", timeout=120)
        scrape_s = time.monotonic() - t0
        assert status == 200, data[:300]
        assert b'\nshardq_shard_up{shard="0"} 1.0\n' in data, re.findall(rb"\nshardq_shard_up\S* \S+", data)
        # every queue's series: one limit gauge and one counter of each, by its name
        limited = re.findall(rb'\nshardq_queue_limit_in_flight\{queue="(\d{8})q+",shard="0"\} 0\.0', data)
        assert sorted(map(int, limited)) == list(range(limits.QUEUES_MAX))
        assert data.count(b"\nshardq_queue_enqueued_total{") == limits.QUEUES_MAX
        read_s = float(re.search(rb"\nshardq_scrape_duration_seconds (\S+)\n", data).group(1))
        # the console's overview reads the same pages
        t0 = time.monotonic()
        status, _, body = request(svc.http_url(), "/api/overview", headers=BEARER, timeout=120)
        overview_s = time.monotonic() - t0
        assert status == 200, body[:300]
        overview = json.loads(body)
        assert overview["shards"][0]["up"] and overview["shards"][0]["error"] is None
        assert len(overview["queues"]) == limits.QUEUES_MAX
        assert all(q["limits"]["concurrency"] == 10 for q in overview["queues"])
        # what the scrape cost (docs/operations.md, "Metrics"; the pages: tests/shard/test_metrics_pages.py)
        print(f"\nqueues made in {made_s:.1f} s; /metrics {len(data)} bytes in {scrape_s:.1f} s, the shards read in "
              f"{read_s:.2f} s; /api/overview {len(body)} bytes in {overview_s:.1f} s")
