"""The docs site (mkdocs.yml: the guides in docs/ and the API reference generated from the
docstrings) builds with ``mkdocs build --strict``: a page missing from the nav, a link to a
page that does not exist, or a docstring role that names nothing in the package fails it
(docs/reference/rst_roles.py turns the roles into links and warns on a dead one)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

from support.service import REPO

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None,
    reason="mkdocs or mkdocstrings[python] is not installed (pip install -e '.[docs]'; the test extra has both)")

#: Material's notice about MkDocs 2 is printed on every build; it says nothing about ours.
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def build(config: str, site: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", config,
                           "--site-dir", site], cwd=os.path.dirname(config), env=ENV, capture_output=True,
                          text=True, timeout=300)


def test_the_site_builds_strict_with_the_api_reference(tmp_path):
    t0 = time.monotonic()
    r = build(os.path.join(REPO, "mkdocs.yml"), str(tmp_path / "site"))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-4000:]
    assert "WARNING" not in r.stderr, r.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "upgrades/index.html", "operations/index.html", "reference/queue/index.html"):
        assert (site / page).is_file(), page
    queue = (site / "reference" / "queue" / "index.html").read_text()
    # generated from the docstrings: the protocol's methods, and a role turned into a link
    assert 'id="shardq.client.queue.Queue.enqueue"' in queue
    assert 'href="../errors/#shardq.errors.LeaseLost"' in queue
    assert ":class:" not in queue
    print(f"mkdocs build --strict: {took:.1f} s")


def test_a_role_that_names_nothing_fails_the_build(tmp_path):
    """The check the site's build relies on, on a package of two names: a role naming one
    of them becomes a link, a role naming neither fails ``--strict`` with its place."""
    (tmp_path / "shardq").mkdir()
    (tmp_path / "shardq" / "__init__.py").write_text(textwrap.dedent('''\
        """A package. See :class:`~shardq.Real`, :func:`os.fsync` and :class:`Nowhere`."""


        class Real:
            """Real: :meth:`go` and :class:`ValueError`."""

            def go(self):
                """Go."""
        '''))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n::: shardq\n")
    roles = os.path.join(REPO, "docs", "reference", "rst_roles.py")
    (tmp_path / "mkdocs.yml").write_text(textwrap.dedent(f"""\
        site_name: t
        plugins:
          - mkdocstrings:
              handlers:
                python:
                  paths: [.]
                  options:
                    extensions: [{roles}:RstRoles]
                    show_source: false
        """))
    r = build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert r.returncode == 1
    warnings = [l for l in r.stderr.splitlines() if l.startswith("WARNING")]
    assert len(warnings) == 1 and "shardq/__init__.py:1: :class:`Nowhere` names nothing in shardq" in warnings[0], \
        r.stderr[-3000:]

    (tmp_path / "shardq" / "__init__.py").write_text(
        (tmp_path / "shardq" / "__init__.py").read_text().replace(" and :class:`Nowhere`", ""))
    r = build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert r.returncode == 0, r.stderr[-3000:]
    html = (tmp_path / "site" / "index.html").read_text()
    assert 'href="#shardq.Real"' in html and 'href="#shardq.Real.go"' in html
    assert "<code>os.fsync()</code>" in html and ":class:" not in html
