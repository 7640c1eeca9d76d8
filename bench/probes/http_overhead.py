"""Does the HTTP listener (metrics and console) slow the shards down? Figures A and M with
the listener off and on, in one run, scraped every second while on.

    python -m bench.probes.http_overhead [--jobs 5000] [--rounds 3] [--shards 2] [--json PATH]
    python -m bench.probes.http_overhead --quick          # 300 jobs, 1 round: checks that it runs

* **A** enqueue, 1 producer, one call per job (``bench.workloads.enqueue_single``).
* **M** 16 producer processes and 4 consumer processes at once, one job per call
  (``bench.mpmc.run``), every delivered body checked.

Each figure runs against a fresh ``shardq serve`` (a real process, ``--shards N``) with
``[http] listen = ""`` (off) or ``"127.0.0.1:0"`` (on). While on, a scraper process GETs
``/metrics`` every second and ``/api/overview`` every two (what Prometheus and an open
console do). Off and on alternate, their order flipping each round; medians are reported
with the difference on/off. The target is within 3%; on a busy machine noise can exceed
that, which is why final figures are taken on a quiet one.

Exit status: 0 every figure ran, every job was delivered exactly once and every scrape was
answered; 1 otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from .. import mpmc
from ..jobs import make_items
from ..peers.base import Adapter, ClientSpec, SkipPeer
from ..workloads import enqueue_single

PRODUCERS_M, CONSUMERS_M = 16, 4
SCRAPE_EVERY_S = 1.0
START_TIMEOUT_S = 60.0


def _scrape_loop(base_url: str, token: str, stop, counts) -> None:
    """A separate process, so its work never shares a GIL with the producer of figure A.
    ``token``: the console's token (serve makes one in the data dir), sent as a bearer
    token, so the console API's calls are answered, not refused."""
    tick = 0
    next_at = time.monotonic()
    while not stop.is_set():
        paths = ["metrics"] + (["api/overview"] if tick % 2 == 0 else [])
        for path in paths:
            try:
                req = urllib.request.Request(base_url + path, headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                    ok = r.status == 200
            except OSError:
                ok = False
            with counts.get_lock():
                counts[0 if ok else 1] += 1
        tick += 1
        next_at += SCRAPE_EVERY_S
        stop.wait(max(0.0, next_at - time.monotonic()))


class ServeAdapter(Adapter):
    """shardq through a real ``shardq serve`` process, HTTP listener on or off."""

    name = "shardq serve"
    durability = "WAL, fsync before reply"
    thread_safe = True

    def __init__(self, shards: int, http: bool):
        self.shards, self.http = shards, http
        self.proc: subprocess.Popen | None = None
        self.data_dir = ""
        self.url: str | None = None
        self.client = None

    def setup(self, tmpdir: str) -> None:
        import shardq
        from ..peers.shardq_peer import ShardqClient
        self.data_dir = os.path.join(tmpdir, "d")
        cfg = os.path.join(tmpdir, "shardq.toml")
        with open(cfg, "w") as f:
            f.write('[queues.default]\nvisibility_timeout = 30\n')
        self.log = open(os.path.join(tmpdir, "serve.log"), "ab")
        # the listener (any free port, or off) by the flag: a SHARDQ_HTTP_LISTEN of the user's
        # shell beats a config, not the flag
        self.proc = subprocess.Popen([sys.executable, "-m", "shardq.cli", "serve", "--config", cfg, "--data-dir",
                                      self.data_dir, "--shards", str(self.shards),
                                      "--http-listen", "127.0.0.1:0" if self.http else ""], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise SkipPeer(f"shardq serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with shardq.connect(self.data_dir, retry_s=0.2, request_timeout_s=2) as q:
                    q.ping()
                if self.http:
                    with open(os.path.join(self.data_dir, "run", "http.json")) as f:
                        self.url = json.load(f)["url"]
                break
            except (OSError, ValueError, shardq.ShardqError):
                if time.monotonic() > deadline:
                    raise SkipPeer("shardq serve did not become ready") from None
                time.sleep(0.05)  # polling for readiness, not synchronisation
        self.client = ShardqClient(shardq.connect(self.data_dir))

    def client_spec(self) -> ClientSpec:
        return ClientSpec("bench.peers.shardq_peer", "connect_client", {"data_dir": self.data_dir})

    def server_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def teardown(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self.log.close()


def figure(name: str, http: bool, a, tag: str) -> dict[str, Any]:
    """One figure against a fresh service; with the listener on, scraped all along."""
    tmp = tempfile.mkdtemp(prefix="sqhttp", dir=a.tmpdir)
    adapter = ServeAdapter(a.shards, http)
    ctx = mp.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("q", 2)
    scraper = None
    try:
        adapter.setup(tmp)
        if http:
            with open(os.path.join(adapter.data_dir, "http-token")) as f:
                token = f.read().strip()
            scraper = ctx.Process(target=_scrape_loop, args=(adapter.url, token, stop, counts), daemon=True)
            scraper.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while counts[0] + counts[1] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)  # the scraper's start-up must not overlap the timed figure
        items = make_items(tag, a.jobs)
        if name == "A":
            out = enqueue_single(adapter, items)
            out["delivered_once"] = True  # A only enqueues; M checks deliveries
        else:
            out = mpmc.run(adapter, items, batch=False, stall_s=a.stall_s, deadline_s=a.deadline_s,
                           producers=PRODUCERS_M, consumers=CONSUMERS_M)
            out["delivered_once"] = out["delivery"]["exactly_once"]
    finally:
        stop.set()
        if scraper is not None:
            scraper.join(15)
            if scraper.is_alive():
                scraper.kill()
        adapter.teardown()
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(http=http, scrapes_ok=counts[0], scrapes_failed=counts[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.http_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="300 jobs, 1 round")
    ap.add_argument("--json", default=os.path.join("bench", "results", "http_overhead.json"))
    ap.add_argument("--tmpdir", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.jobs, a.rounds = 300, 1
    a.stall_s, a.deadline_s = 10.0, 600.0
    runs: list[dict] = []
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for fig in ("A", "M"):
            for http in order:
                res = figure(fig, http, a, f"{fig}{r}{'on' if http else 'off'}")
                res.update(figure=fig, round=r)
                runs.append(res)
                print(f"round {r} {fig} http {'on ' if http else 'off'} {res['jobs_per_s']:>10,.0f} jobs/s"
                      + (f"  scrapes {res['scrapes_ok']} ok {res['scrapes_failed']} failed" if http else ""),
                      file=sys.stderr, flush=True)
    summary = {}
    print(f"{'figure':<8}{'http off':>14}{'http on':>14}{'on/off':>10}")
    for fig in ("A", "M"):
        med = {http: statistics.median(x["jobs_per_s"] for x in runs if x["figure"] == fig and x["http"] is http)
               for http in (False, True)}
        diff = (med[True] / med[False] - 1) * 100 if med[False] else float("nan")
        summary[fig] = {"off_jobs_per_s": med[False], "on_jobs_per_s": med[True], "difference_pct": diff}
        print(f"{fig:<8}{med[False]:>14,.0f}{med[True]:>14,.0f}{diff:>+9.1f}%")
    ok = (all(x["delivered_once"] for x in runs)
          and all(x["scrapes_failed"] == 0 and x["scrapes_ok"] > 0 for x in runs if x["http"]))
    out = {"jobs": a.jobs, "rounds": a.rounds, "shards": a.shards, "cpus": os.cpu_count(),
           "producers_M": PRODUCERS_M, "consumers_M": CONSUMERS_M, "scrape_every_s": SCRAPE_EVERY_S,
           "summary": summary, "runs": runs, "ok": ok}
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"{'ok' if ok else 'FAILED'}: details in {a.json}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
