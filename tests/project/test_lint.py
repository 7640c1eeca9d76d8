"""ruff and mypy, as configured in pyproject.toml ([tool.ruff], [tool.mypy]), run by the test
command itself, so that the configuration and the code cannot drift apart. The same two run
from .pre-commit-config.yaml; docs/contributing.md says how to run them by hand."""
from __future__ import annotations

import io
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import tokenize

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


# ---------------------------------------------------------------------- type: ignore
# An ignore names its error code and says why: `# type: ignore[code]  # why` on the line, or
# a comment line just above. The code keeps it from hiding another error on that line; the
# reason says what mypy cannot see, so that a reader can check it still holds.
_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*\])?(?P<rest>.*)")


def unexplained_ignores(source: str) -> list[tuple[int, str]]:
    """``(line, why)`` for each ``# type: ignore`` of ``source`` without a code or a reason
    (a comment token that starts with it is what mypy reads as one)."""
    lines = source.splitlines()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        m = _IGNORE.match(tok.string) if tok.type == tokenize.COMMENT else None
        if m is None:
            continue
        row = tok.start[0]
        if m["codes"] is None:
            out.append((row, "no error code"))
            continue
        reason = m["rest"].strip().lstrip("#").strip()
        above = lines[row - 2].strip() if row >= 2 else ""
        if not (m["rest"].strip().startswith("#") and reason) and not above.startswith("#"):
            out.append((row, "no reason (a `# why` after it, or a comment line just above)"))
    return out


def test_every_type_ignore_names_its_code_and_says_why():
    bad = []
    for path in sorted(pathlib.Path(REPO, "shardq").rglob("*.py")):
        for row, why in unexplained_ignores(path.read_text()):
            bad.append(f"{path.relative_to(REPO)}:{row}: {why}")
    assert not bad, "\n".join(bad)


def test_the_ignore_check_sees_a_missing_code_or_reason():
    source = (
        "a = f()  # type: ignore\n"                         # 1: no code
        "b = f()  # type: ignore[arg-type]\n"               # 2: no reason
        "c = f()  # type: ignore[arg-type]  #\n"            # 3: an empty reason
        "d = f()  # type: ignore[arg-type]  # ints here\n"  # fine
        "# the reason, on the line above\n"
        "e = f()  # type: ignore[misc, override]\n"         # fine
        "s = '# type: ignore'  # not a comment: fine\n"
        "g = f()  # see ``# type: ignore`` above\n"         # a comment about one: fine
        "h = (f(),  # type: ignore[index]  # why\n"
        "     f())  # type: ignore[index]\n"                # 10: the line above is code
    )
    assert [row for row, _ in unexplained_ignores(source)] == [1, 2, 3, 10]
