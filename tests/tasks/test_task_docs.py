"""docs/tasks.md's "Exactly-once effects" example as a reader runs it: twice, and from a
directory of their own (no ``var/``). Its store was ``var/payments.sqlite`` while
``App.embedded()`` makes a new service each run: the second run was refused
(``InvalidConfig: this idempotency store holds marks of shardq service X, not Y``), and a
directory without ``var/`` gave a bare ``sqlite3.OperationalError``. (tests/project/test_docs.py
runs every example once, in a sandbox that has ``var/``.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import doc_blocks
from support.service import REPO


def _example(heading: str) -> doc_blocks.Block:
    """The first runnable block under ``heading`` in docs/tasks.md."""
    with open(os.path.join(REPO, "docs", "tasks.md")) as f:
        start = f.read().split("\n").index(heading) + 1
    return next(b for b in doc_blocks.read("docs/tasks.md", REPO) if b.line > start and b.runnable)


@pytest.mark.parametrize("var", [False, True], ids=["fresh directory", "with var"])
def test_the_exactly_once_example_runs_twice(tmp_path, var):
    if var:  # as the docs' sandbox, and a reader who runs the README first
        (tmp_path / "var").mkdir()
    block = _example("## Exactly-once effects")
    assert block.lang == "python" and "App.embedded()" in block.text and "SqliteStore(" in block.text
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outputs = []
    for run in (1, 2):
        out = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, f"run {run}: {out.stderr[-2000:]}"
        outputs.append(out.stdout)
    assert sorted(p.name for p in tmp_path.rglob("*")) == (["var"] if var else [])  # it leaves nothing behind
    # The output shown below it (which the docs test checks too), each run: every payment once.
    assert block.output is not None and all(doc_blocks.matches(block.output.text, o) for o in outputs), outputs
