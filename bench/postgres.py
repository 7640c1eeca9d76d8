"""PostgreSQL figures, in one run: ``python -m bench.postgres [--quick] [--dsn DSN]``.

* **P1** worker drain, idempotency store in PostgreSQL vs SQLite: N jobs (keys ``k{i % 100}``)
  already in the queue, one ``Worker`` (threads, ``--concurrency``) whose handler inserts one
  row through ``ctx.db``; timed from ``run()`` to the last ack; each job's effect checked once.
* **P2** outbox latency: a producer commits one outbox row per transaction at an offered
  rate (open loop: row ``i`` is due at ``start + i/rate``); a relay and a consumer run
  beside it. Latency = from the producer's COMMIT returning to the consumer holding the
  lease. p50 / p99.
* **P3** outbox throughput: M rows committed up front (keys ``k{i % 100}``); one relay
  moves them while a consumer drains; rows/s from the relay's start to the last lease.

PostgreSQL: ``--dsn`` (a database the benchmark may create tables in), else a throwaway
server started like the tests' (tests/support/pg.py) but with ``fsync=on``, so its commits are as
durable as SQLite's ``synchronous=FULL``. shardq: ``shardq.open`` (2 shards) in a temp dir.
Everything goes to ``bench/results/postgres.json``; progress to stderr, the table to stdout.
Exit 0 when every effect and every row was delivered exactly once. No timing is checked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time

import psycopg

import shardq
from shardq import outbox
from shardq.consumer.idempotency import SqliteStore
from shardq.consumer.postgres import PostgresStore
from shardq.consumer.worker import Worker

from .latency import percentiles_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results", "postgres.json")
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pg_handler(ctx) -> None:
    ctx.db.execute("INSERT INTO bench_effects (job_id) VALUES (%s)", (ctx.job_id,))


def _sqlite_handler(ctx) -> None:
    ctx.db.execute("INSERT INTO bench_effects (job_id) VALUES (?)", (ctx.job_id,))


def drain(q, store, handler, count_effects, jobs: int, concurrency: int) -> dict:
    """P1 for one store."""
    ids = q.enqueue_many([{"body": str(i).encode(), "key": f"k{i % 100}"} for i in range(jobs)])
    worker = Worker(q, handler, concurrency=concurrency, idempotency=store, prune_every_s=None)
    t0 = time.monotonic()
    stats = worker.run(until_idle=True)
    elapsed = time.monotonic() - t0
    effects = count_effects()
    return {"jobs": jobs, "seconds": elapsed, "jobs_per_s": jobs / elapsed,
            "succeeded": stats.succeeded, "exactly_once": effects == len(set(ids)) == stats.succeeded}


class Consumer(threading.Thread):
    """Leases and acks; records (monotonic time of the lease, body)."""

    def __init__(self, q_factory, expect: int):
        super().__init__(daemon=True)
        self.q_factory, self.expect, self.got = q_factory, expect, []
        self.done = threading.Event()

    def run(self) -> None:
        with self.q_factory() as q:
            while len(self.got) < self.expect and not self.done.is_set():
                leases = q.dequeue_many("default", max_jobs=500, wait=0.5)
                now = time.monotonic()
                self.got += [(now, lease.body) for lease in leases]
                if leases:
                    q.ack_many(leases)
        self.done.set()


def _relay_thread(dsn: str, q_factory) -> tuple[threading.Thread, list]:
    holder: list = []

    def run():
        with q_factory() as q:
            relay = outbox.Relay(dsn, q, poll_s=1.0)
            holder.append(relay)
            try:
                relay.run()
            finally:
                relay.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    while not holder or not holder[0].waiting:  # connected, and asleep on the channel
        time.sleep(0.01)
    return t, holder


def outbox_latency(dsn: str, q_factory, rows: int, rate_per_s: float) -> dict:
    """P2."""
    relay_t, holder = _relay_thread(dsn, q_factory)
    consumer = Consumer(q_factory, rows)
    consumer.start()
    committed: dict[bytes, float] = {}
    try:
        with psycopg.connect(dsn) as conn:
            start = time.monotonic()
            for i in range(rows):
                ahead = start + i / rate_per_s - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                body = f"lat-{i}".encode()
                outbox.enqueue(conn, body, key=f"k{i % 100}")
                conn.commit()
                committed[body] = time.monotonic()
        consumer.join(120)
    finally:
        holder[0].stop()
        consumer.done.set()
        relay_t.join(30)
    lat = [t - committed[b] for t, b in consumer.got if b in committed]
    bodies = [b for _, b in consumer.got]
    return {"rows": rows, "offered_per_s": rate_per_s, "latency_ms": percentiles_ms(lat),
            "exactly_once": sorted(bodies) == sorted(committed) and len(bodies) == len(set(bodies))}


def outbox_throughput(dsn: str, q_factory, rows: int) -> dict:
    """P3."""
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO shardq_outbox (queue, key, body) SELECT 'default', 'k' || (g %% 100), "
                     "convert_to('tp-' || g, 'UTF8') FROM generate_series(1, %s) g", (rows,))
    consumer = Consumer(q_factory, rows)
    consumer.start()
    t0 = time.monotonic()
    with q_factory() as q:
        relay = outbox.Relay(dsn, q)
        stats = relay.run(until_idle=True)
        relay.close()
    relay_s = time.monotonic() - t0
    consumer.join(120)
    end = max((t for t, _ in consumer.got), default=t0)
    bodies = [b for _, b in consumer.got]
    return {"rows": rows, "relay_rows_per_s": rows / relay_s, "end_to_end_rows_per_s": rows / (end - t0),
            "batches": stats.batches,
            "exactly_once": len(bodies) == len(set(bodies)) == rows == stats.moved}


def run(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="sqpg", dir=args.tmpdir)
    server = None
    try:
        dsn = args.dsn
        if dsn is None:
            sys.path.insert(0, TESTS)
            from support.pg import PgServer, find_bindir
            bindir = find_bindir()
            if bindir is None:
                raise SystemExit("no PostgreSQL found: pass --dsn or run bash .ci/setup-system")
            server = PgServer(bindir)
            server.init(fsync=True)
            server.start()
            dsn = server.dsn(server.create_db())
        with psycopg.connect(dsn, autocommit=True) as conn:
            for t in ("bench_effects", "shardq_processed", "shardq_processed_meta"):
                conn.execute(f"DROP TABLE IF EXISTS {t}")
            conn.execute("CREATE TABLE bench_effects (job_id bigint)")
        outbox.install(dsn)
        data_dir = os.path.join(tmp, "data")
        out: dict = {"jobs": args.jobs, "concurrency": args.concurrency}
        with shardq.open(data_dir, shards=2) as q:
            def factory():
                return shardq.connect(data_dir)

            progress(f"P1 drain, PostgreSQL store, {args.jobs} jobs")
            store = PostgresStore(dsn)

            def pg_effects():
                with psycopg.connect(dsn) as c:
                    return c.execute("SELECT count(DISTINCT job_id) FROM bench_effects").fetchone()[0]
            out["drain_postgres"] = drain(q, store, _pg_handler, pg_effects, args.jobs, args.concurrency)
            store.close()

            progress(f"P1 drain, SQLite store, {args.jobs} jobs")
            path = os.path.join(tmp, "effects.sqlite")
            con = sqlite3.connect(path)
            con.execute("CREATE TABLE bench_effects (job_id INTEGER)")
            con.commit()
            store = SqliteStore(path)

            def sqlite_effects():
                return con.execute("SELECT count(DISTINCT job_id) FROM bench_effects").fetchone()[0]
            out["drain_sqlite"] = drain(q, store, _sqlite_handler, sqlite_effects, args.jobs, args.concurrency)
            store.close()
            con.close()

            progress(f"P2 outbox latency, {args.latency_rows} rows at {args.rate}/s")
            out["outbox_latency"] = outbox_latency(dsn, factory, args.latency_rows, args.rate)
            progress(f"P3 outbox throughput, {args.rows} rows")
            out["outbox_throughput"] = outbox_throughput(dsn, factory, args.rows)
        out["ok"] = all(v["exactly_once"] for v in out.values() if isinstance(v, dict))
        return out
    finally:
        if server is not None:
            server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def table(r: dict) -> str:
    lines = ["figure                         value",
             f"P1 drain, PostgreSQL store     {r['drain_postgres']['jobs_per_s']:10.0f} jobs/s",
             f"P1 drain, SQLite store         {r['drain_sqlite']['jobs_per_s']:10.0f} jobs/s",
             f"P2 outbox commit->lease p50    {r['outbox_latency']['latency_ms']['p50']:10.1f} ms",
             f"P2 outbox commit->lease p99    {r['outbox_latency']['latency_ms']['p99']:10.1f} ms",
             f"P3 outbox relay                {r['outbox_throughput']['relay_rows_per_s']:10.0f} rows/s",
             f"P3 outbox commit->leased       {r['outbox_throughput']['end_to_end_rows_per_s']:10.0f} rows/s",
             f"every effect and row once      {r['ok']!s:>10}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.postgres", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a check that it runs")
    p.add_argument("--dsn", help="use this database instead of a throwaway server")
    p.add_argument("--jobs", type=int, default=None, help="P1 jobs (default 5000; quick 300)")
    p.add_argument("--rows", type=int, default=None, help="P3 rows (default 20000; quick 1000)")
    p.add_argument("--latency-rows", type=int, default=None, help="P2 rows (default 2000; quick 100)")
    p.add_argument("--rate", type=float, default=None, help="P2 offered rows/s (default 200; quick 100)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", default=RESULTS)
    p.add_argument("--tmpdir", default=None)
    args = p.parse_args(argv)
    for name, full, quick in (("jobs", 5000, 300), ("rows", 20000, 1000), ("latency_rows", 2000, 100),
                              ("rate", 200.0, 100.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    result = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
