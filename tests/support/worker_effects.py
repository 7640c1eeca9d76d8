"""The effects database of the worker-process tests: created by ``_setup``, read by ``_effects``."""
from __future__ import annotations

import os
import sqlite3
import textwrap




HANDLER = textwrap.dedent("""
    import os, random, time

    CRASH_P = float(os.environ.get("CRASH_P", "0"))
    SLOW_S = float(os.environ.get("SLOW_S", "0"))

    def handle(ctx):
        key, seq = ctx.body.decode().split(":")
        if random.random() < CRASH_P:
            os._exit(3)                      # crash before the effect
        if SLOW_S:
            time.sleep(SLOW_S)               # the work itself
        ctx.db.execute("INSERT INTO effects(job_id, key, seq) VALUES (?, ?, ?)",
                       (ctx.job_id, key, int(seq)))
        if random.random() < CRASH_P:
            os._exit(3)                      # crash inside the transaction: rolled back
""")


def _setup(tmp: str) -> str:
    with open(os.path.join(tmp, "handler_mod.py"), "w") as f:
        f.write(HANDLER)
    db = os.path.join(tmp, "effects.sqlite")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE effects (seqno INTEGER PRIMARY KEY AUTOINCREMENT, "
                "job_id INTEGER UNIQUE, key TEXT, seq INTEGER)")
    con.commit()
    con.close()
    return db


def _effects(db: str) -> list[tuple[int, int, str, int]]:
    con = sqlite3.connect(db, timeout=10)
    try:
        return con.execute("SELECT seqno, job_id, key, seq FROM effects ORDER BY seqno").fetchall()
    finally:
        con.close()
