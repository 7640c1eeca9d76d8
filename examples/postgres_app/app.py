"""An order service on PostgreSQL, with shardq in both directions.

* ``place_order`` writes the order and enqueues "send the receipt" in **one** transaction
  (``shardq.outbox.enqueue``): a declined payment rolls both back, so no receipt job exists
  for an order that does not exist, and no committed order is without its job.
* ``handle`` is the worker's handler: it writes the receipt through ``ctx.db``, in the same
  transaction as the worker's processed mark (``shardq worker ... --idempotency
  postgresql://...``), so each order gets exactly one receipt however often the job runs.

Run it (a PostgreSQL you can create tables in, and ``shardq serve`` running)::

    python -m examples.postgres_app.app setup --dsn postgresql://app@localhost/shop
    shardq outbox relay --dsn postgresql://app@localhost/shop &
    shardq worker examples.postgres_app.app:handle --idempotency postgresql://app@localhost/shop &
    python -m examples.postgres_app.app orders 100 --dsn postgresql://app@localhost/shop
    python -m examples.postgres_app.app report --dsn postgresql://app@localhost/shop
"""
from __future__ import annotations

import argparse
import json
import random
import sys

import psycopg

import shardq

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text NOT NULL,
    cents       integer NOT NULL CHECK (cents > 0)
);
CREATE TABLE IF NOT EXISTS receipts (
    order_id    bigint PRIMARY KEY REFERENCES orders (id),
    job_id      text NOT NULL,
    line        text NOT NULL
);
"""


class Declined(Exception):
    """The payment provider said no: the order and its receipt job roll back together."""


def setup(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(SCHEMA)
    shardq.outbox.install(dsn)  # the outbox tables (the relay would create them too)


def place_order(conn: psycopg.Connection, customer: str, cents: int, *, declined: bool = False) -> int:
    """One transaction: the order row and its "send the receipt" job, or neither."""
    with conn.transaction():
        order_id = conn.execute("INSERT INTO orders (customer, cents) VALUES (%s, %s) RETURNING id",
                                (customer, cents)).fetchone()[0]
        body = json.dumps({"order_id": order_id, "customer": customer, "cents": cents}).encode()
        shardq.outbox.enqueue(conn, body, key=f"customer-{customer}")  # per-customer order
        if declined:
            raise Declined(f"order {order_id}")
    return order_id


def handle(ctx) -> None:
    """Worker handler: the receipt and the processed mark commit together."""
    order = json.loads(ctx.body)
    line = f"receipt for order {order['order_id']}: {order['cents'] / 100:.2f} to {order['customer']}"
    ctx.db.execute("INSERT INTO receipts (order_id, job_id, line) VALUES (%s, %s, %s)",
                   (order["order_id"], str(ctx.job_id), line))


def place_orders(dsn: str, n: int, seed: int = 1) -> dict:
    """``n`` orders from 5 customers; one payment in five is declined."""
    rng = random.Random(seed)
    placed, declined = [], 0
    with psycopg.connect(dsn) as conn:
        for _ in range(n):
            try:
                placed.append(place_order(conn, f"c{rng.randrange(5)}", rng.randint(100, 9999),
                                          declined=rng.random() < 0.2))
            except Declined:
                declined += 1
    return {"placed": len(placed), "declined": declined}


def report(dsn: str) -> dict:
    with psycopg.connect(dsn) as conn:
        orders = conn.execute("SELECT count(*) FROM orders").fetchone()[0]
        receipts = conn.execute("SELECT count(*) FROM receipts").fetchone()[0]
        orphans = conn.execute("SELECT count(*) FROM orders o LEFT JOIN receipts r ON r.order_id = o.id "
                               "WHERE r.order_id IS NULL").fetchone()[0]
    return {"orders": orders, "receipts": receipts, "orders_without_receipt": orphans}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.postgres_app.app")
    p.add_argument("command", choices=("setup", "orders", "report"))
    p.add_argument("n", nargs="?", type=int, default=10)
    p.add_argument("--dsn", required=True)
    args = p.parse_args(argv)
    if args.command == "setup":
        setup(args.dsn)
        out = {"ok": True}
    elif args.command == "orders":
        out = place_orders(args.dsn, args.n)
    else:
        out = report(args.dsn)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
