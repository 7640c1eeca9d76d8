"""ruff and mypy, as configured in pyproject.toml ([tool.ruff], [tool.mypy]), run by the test
command itself, so that the configuration and the code cannot drift apart. The same two run
from .pre-commit-config.yaml; docs/contributing.md says how to run them by hand."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Outside the repo and kept between runs: a warm cache makes mypy take well under a second.
MYPY_CACHE = os.path.join(tempfile.gettempdir(), f"shardq-mypy-cache-{os.getuid()}")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_finds_nothing():
    proc = _run("mypy", "--cache-dir", MYPY_CACHE, "--no-error-summary", "--hide-error-context")
    assert proc.returncode == 0, proc.stdout + proc.stderr
