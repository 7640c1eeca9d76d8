"""Time is read in one place, shardq/clock.py (``SystemClock``, ``FakeClock``): the state
takes ``now`` from its caller and every loop gets a ``Clock``. This test reads every module
of shardq/ for a call that reads a clock of the ``time`` module (``time.time()``,
``time.monotonic()``, ``time.perf_counter()``, their ``_ns`` forms, ``from time import
...``) and fails on one outside the list below. The list only shrinks: a file that no
longer reads time fails the test too, until its line is removed. The shard and the log
(shardq/shard/, shardq/wal/) read none, and since the idempotency stores take a Clock, no
file but clock.py does."""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "shardq")
READS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns", "process_time"}

#: file -> how many time reads it still has (the to-do list; clock.py is the one place meant for them)
ALLOWED = {
    "shardq/clock.py": 2,
}


def _reads(source: str) -> int:
    """How many clock reads of the ``time`` module ``source`` holds (calls, and names
    imported from it, each counted once per use)."""
    tree = ast.parse(source)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "time" for alias in node.names if alias.name in READS}
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in READS and isinstance(node.value, ast.Name) \
                and node.value.id == "time":
            n += 1
        elif isinstance(node, ast.Name) and node.id in imported:
            n += 1
    return n


def _found() -> dict[str, int]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                n = _reads(open(path).read())
                if n:
                    out[os.path.relpath(path, REPO)] = n
    return out


def test_time_is_read_only_where_the_list_allows_and_the_list_only_shrinks():
    found = _found()
    new = {f: n for f, n in found.items() if n > ALLOWED.get(f, 0)}
    assert not new, f"time read outside shardq/clock.py (take a Clock instead): {new}"
    done = {f: n for f, n in ALLOWED.items() if found.get(f, 0) < n}
    assert not done, f"fewer time reads than listed: lower or remove their lines in ALLOWED: {done}"


def test_the_shard_and_the_log_read_no_time():
    assert not [f for f in _found() if f.startswith(("shardq/shard/", "shardq/wal/", "shardq/protocol/"))]


def test_the_reader_counts_every_form():
    src = ("import time\nfrom time import monotonic as mono, sleep\n"
           "a = time.time()\nb = time.perf_counter_ns()\nc = mono()\ntime.sleep(1)\nsleep(1)\nf = time.monotonic\n")
    assert _reads(src) == 4  # two calls, the alias called once, and a reference (a read waiting to happen)
