"""Send work to the example app: ``python -m examples.tasks_app.produce --users 100``.

Creates the effect tables in ``--db`` (the worker's ``--idempotency`` file), then sends one
``record_signup`` and one ``send_notification`` per user, in two batch calls.
"""
from __future__ import annotations

import argparse

from .tasks import app, init_db, record_signup, send_notification


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.tasks_app.produce")
    p.add_argument("--users", type=int, default=10)
    p.add_argument("--db", default="var/example.sqlite")
    args = p.parse_args(argv)
    init_db(args.db)
    signups = record_signup.send_many([((u, f"user{u}@example.com"), {}) for u in range(args.users)])
    notes = send_notification.send_many([((u,), {"text": "welcome!"}) for u in range(args.users)])
    print(f"sent {len(signups)} signups and {len(notes)} notifications")
    app.close()


if __name__ == "__main__":
    main()
