"""Every example in README.md and docs/*.md runs as written, with the output and exit status
the text states; the public API's docstring examples run as doctests.

How a block is run, and the markers that change it, are in ``doc_blocks`` (markers) and
``doc_runner`` (one sandbox copy of the repo layout and one real ``shardq serve`` per
document, blocks in document order). docs/contributing.md says the same for doc writers.
"""
from __future__ import annotations

import errno
import glob
import os
import socket
import subprocess
import textwrap

import pytest

from support import doc_blocks
from support.doc_blocks import MarkerError, matches, parse
from support.doc_runner import DEFAULT_LISTEN, REPO, ExampleFailed, Sandbox, given_steps_dropped, long_running

DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


@pytest.mark.parametrize("doc", DOCS)
def test_examples_run_as_written(doc):
    """Each document's examples, in a sandbox of their own, while the default HTTP port is
    held, as it is on a machine where the reader runs the README's first command (the
    service) and then its second (these tests): the sandbox does not need that port."""
    blocks = doc_blocks.read(doc, REPO)
    holder = socket.socket()
    try:
        host, port = DEFAULT_LISTEN.rsplit(":", 1)
        holder.bind((host, int(port)))
        holder.listen(1)
    except OSError as e:
        assert e.errno == errno.EADDRINUSE, e  # held already: the case under test
    try:
        with Sandbox() as sb:
            for block in blocks:
                sb.run(block)
            sb.stop_service()
            # `serve` exits 0 on SIGTERM and leaves no shard behind (docs/operations.md), every time.
            assert all(code == 0 for code in sb.stop_codes), (sb.stop_codes, sb.service_tail())
    finally:
        holder.close()


def test_the_sandbox_listens_on_a_port_of_its_own_and_reads_the_examples_so():
    """The default listener's address the sandbox stands in for is the one shardq and the
    repo's config use, and an example's ``127.0.0.1:7781`` (with its output) becomes the
    sandbox's own address."""
    from shardq.config import Config, load
    assert Config().http.listen == DEFAULT_LISTEN == load(os.path.join(REPO, "config", "shardq.toml")).http.listen
    with Sandbox(service=False) as sb:
        assert sb.env["SHARDQ_HTTP_LISTEN"] == sb.listen != DEFAULT_LISTEN
        block = parse("```sh\ncurl -s http://127.0.0.1:7781/metrics\n```\n"
                      "<!-- output -->\n```text\nhttp://127.0.0.1:7781/\n```\n", "x.md")[0]
        here = sb._here(block)
        assert here.text == f"curl -s http://{sb.listen}/metrics\n" and here.output.text == f"http://{sb.listen}/\n"


def test_the_documents_hold_examples_that_run():
    """The operations guide and the README are covered by running examples, not only
    illustrations (issue 15: "covers every example in README.md and docs/operations.md")."""
    for doc in ("README.md", "docs/operations.md"):
        blocks = doc_blocks.read(doc, REPO)
        assert sum(b.runnable for b in blocks) >= 3, doc
        assert any(b.output is not None for b in blocks) or any(b.lang == "console" for b in blocks), doc


# --------------------------------------------------------------------------- doctests
DOCTEST_DRIVER = textwrap.dedent("""
    import doctest, inspect, sys
    import shardq, shardq.client.queue
    finder = doctest.DocTestFinder()
    objects = [shardq, shardq.client.queue] + [getattr(shardq, n) for n in shardq.__all__]
    tests = {}
    for obj in objects:
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
            for t in finder.find(obj):
                if t.examples:  # one docstring is found under several names: run it once
                    tests[(t.filename, t.lineno)] = t
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for where in sorted(tests):
        runner.run(tests[where])
    r = runner.summarize(verbose=False)
    print(f"doctests: {len(tests)} docstrings, {r.attempted} examples, {r.failed} failed")
    sys.exit(1 if r.failed else 0)
""")


def test_public_api_docstring_examples_run():
    """Docstrings of ``shardq`` (its exports) and ``shardq.client.queue`` run as doctests,
    from the repo layout with ``shardq serve`` running on the default config."""
    with Sandbox() as sb:
        sb.start_service()
        r = subprocess.run([sb.path(".venv/bin/python"), "-c", DOCTEST_DRIVER], cwd=sb.root, env=sb.env,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    docstrings, examples = (int(w) for w in r.stdout.split()[1:5:2])
    assert docstrings >= 2 and examples >= 10, r.stdout


# --------------------------------------------------------------------------- the harness itself
def test_markers_are_parsed_and_misspelt_ones_refused():
    doc = textwrap.dedent("""\
        intro
        <!-- illustration -->
        ```sh
        rm -rf /
        ```
        <!-- exit 3 -->
        ```sh
        exit 3
        ```
        <!-- output -->
        ```text
        ...
        ```
        Save this as `pkg/mod.py`:

        ```python
        X = 1
        ```
          ~~~~ console
          $ echo hi
          hi
          ~~~~
        """)
    ill, ex3, out, fil, con = parse(doc, "t.md")
    assert (ill.illustration, ill.runnable, ill.line) == (True, False, 3)
    assert (ex3.exit_code, ex3.runnable, ex3.output) == (3, True, out)
    assert (out.is_output, out.runnable, fil.file, fil.runnable) == (True, False, "pkg/mod.py", False)
    assert (con.lang, con.text, con.runnable) == ("console", "$ echo hi\nhi\n", True)
    for bad, words in [("<!-- ilustration -->\n```sh\nx\n```\n", "unknown marker"),
                       ("```text\nx\n```\n<!-- output -->\n```text\ny\n```\n", "must follow a runnable"),
                       ("<!-- exit 2 -->\n```text\nx\n```\n", "not run"),
                       ("Save this as `../x.py`:\n```python\nx\n```\n", "inside the repo"),
                       ("`x.sh`:\n<!-- exit 2 -->\n```sh\nx\n```\n", "written, not run"),
                       ("<!-- file: pkg/mod.py -->\n```python\nx\n```\n", "invisible to a reader"),
                       ("```sh\nnever closed\n", "never closed")]:
        with pytest.raises(MarkerError, match=words):
            parse(bad, "t.md")


@pytest.mark.parametrize("expected, actual, ok", [
    ("42\n", "42\n", True),
    ("42", "43", False),
    ("job ... done", "job 17 done  \n\n", True),
    ("a\n...\nz", "a\nb\nc\nz", True),
    ("...", "anything\nat all", True),
    ("a.b", "axb", False),  # only `...` is a wildcard
    ("", "", True),
    ("", "something", False),
])
def test_expected_output_matching(expected, actual, ok):
    assert matches(expected, actual) is ok


def test_environment_steps_and_long_running_lines_are_recognised():
    assert given_steps_dropped("python3 -m venv .venv && .venv/bin/pip install -q -e . && "
                               ".venv/bin/shardq serve") == ".venv/bin/shardq serve"
    assert given_steps_dropped("bash .ci/setup-system") == ""
    assert given_steps_dropped(".venv/bin/pip install -q -e '.[bench]'") != ""  # not installed here
    assert long_running(".venv/bin/shardq serve --shards 4") == "serve"
    assert long_running("python -m shardq worker app:h --queue q") == "worker"
    assert long_running(".venv/bin/shardq worker --help") is None
    assert long_running(".venv/bin/shardq worker app:h &") is None
    assert long_running(".venv/bin/shardq enqueue 'shardq serve'") is None
    assert long_running(".venv/bin/shardq worker app:h --burst  # ends by itself") is None


@pytest.mark.parametrize("text, file", [
    ("Save this as `myapp/tasks.py`:\n\n```python\nx = 1\n```\n", "myapp/tasks.py"),
    ("`send.py`:\n```python\nx = 1\n```\n", "send.py"),
    ("marks the job done. Save this as `a/b.toml`:\n<!-- illustration -->\n```toml\n```\n", None),
    ("Run `send.py`:\n\n```sh\n.venv/bin/python send.py\n```\n", None),    # a command, not a file
    ("Save this as `x.py`:\n\n\n```python\nx = 1\n```\n", None),            # two blank lines: not its name
    ("It prints (see `x.py`): done\n```python\nx = 1\n```\n", None),
])
def test_a_file_is_named_in_visible_text_above_its_block(text, file):
    if file is None and "illustration" in text:
        with pytest.raises(MarkerError, match="written, not run"):
            parse(text, "t.md")
        return
    block, = parse(text, "t.md")
    assert block.file == file and block.runnable is (file is None)


def test_a_wrong_example_fails_with_its_place_and_output():
    doc = textwrap.dedent("""\
        ```sh
        echo one; exit 2
        ```

        ```python
        print("two")
        ```
        <!-- output -->
        ```text
        three
        ```

        ```console
        $ echo four
        five
        ```

        ```toml
        [queue_defaults]
        max_delivery = 5
        ```
        """)
    blocks = parse(doc, "t.md")
    with Sandbox(service=False) as sb:
        for block, words in zip([b for b in blocks if not b.is_output],
                                ["t.md:1: exit status 2, the document says 0", "does not match t.md:9",
                                 "output of `echo four` does not match", "max_delivery: unknown key"]):
            with pytest.raises(ExampleFailed, match=words):
                sb.run(block)


def test_blocks_share_files_and_the_service_state_in_order():
    doc = textwrap.dedent("""\
        `app/greet.py`:
        ```python
        def hello():
            print("hello from app")
        ```

        ```python
        from app.greet import hello
        hello()
        ```
        <!-- output -->
        ```text
        hello from ...
        ```

        <!-- exit 3 -->
        ```sh
        .venv/bin/shardq dequeue --queue docs-test
        ```

        ```console
        $ .venv/bin/shardq enqueue hi --queue docs-test --key k > /dev/null; echo "exit $?"
        exit 0
        $ .venv/bin/shardq dequeue --queue docs-test | cut -c1-10
        {"job_id":...
        ```
        """)
    with Sandbox() as sb:
        for block in parse(doc, "t.md"):
            sb.run(block)
        assert sb.client().stats()["queues"]["docs-test"]["in_flight"] == 1


def test_a_worker_line_works_its_queue_then_stops_cleanly():
    doc = textwrap.dedent("""\
        Save this as `jobs.py`:

        ```python
        def handle(ctx):
            print("handled", ctx.body)
        ```

        ```sh
        .venv/bin/shardq enqueue one --queue wq && .venv/bin/shardq enqueue two --queue wq
        ```

        ```sh
        .venv/bin/shardq worker jobs:handle --queue wq
        ```

        ```sh
        .venv/bin/shardq worker jobs:nosuch --queue wq
        ```
        """)
    enqueue, work, broken = [b for b in parse(doc, "t.md") if b.file is None]
    with Sandbox() as sb:
        sb.run(parse(doc, "t.md")[0])
        sb.run(enqueue)
        assert sb.client().stats()["queues"]["wq"]["ready"] == 2
        sb.run(work)
        assert set(sb.client().stats()["queues"]["wq"].values()) == {0}  # both done and acked
        with pytest.raises(ExampleFailed, match="exited 2 before it was ready"):
            sb.run(broken)


def test_the_marker_example_in_contributing_md_runs():
    """docs/contributing.md shows the markers inside a ````markdown block: that example is
    itself a document this harness must run as described."""
    example, = [b for b in doc_blocks.read("docs/contributing.md", REPO) if b.lang == "markdown"]
    blocks = parse(example.text, "docs/contributing.md (example)")
    assert [b.file or b.exit_code or b.lang for b in blocks] == ["myapp/jobs.py", 3, "console"]
    assert "Save this as `myapp/jobs.py`:" in example.text  # visible, not a comment
    with Sandbox() as sb:
        for block in blocks:
            sb.run(block)
        assert os.path.exists(sb.path("myapp/jobs.py"))
