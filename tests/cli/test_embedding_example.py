"""docs/operations.md, "Embedding the router": the example runs again and again against one
service with the output the document shows, and leaves no job behind, in its own queue or in
``default``. On the code before the fix it left two delayed jobs in ``default`` (keys k2 and k3),
so a second run failed at ``lease, other = leases`` (``not enough values to unpack``: per-key
order held k2 and k3 behind them), a run once they were due (``too many values``), and the
document's later examples counted them. tests/project/test_docs.py runs it once, in order."""
from __future__ import annotations

from support import doc_blocks
from support.doc_runner import REPO, Sandbox

SECTION = "## Embedding the router"


def the_example() -> doc_blocks.Block:
    with open(f"{REPO}/docs/operations.md", encoding="utf-8") as f:
        text = f.read()
    first_line = text[:text.index(SECTION)].count("\n") + 1
    block = next(b for b in doc_blocks.read("docs/operations.md", REPO) if b.line > first_line)
    assert block.lang == "python" and block.output is not None, block.where
    return block


def test_the_embedding_example_runs_again_with_the_same_output_and_leaves_nothing():
    block = the_example()
    with Sandbox() as sb:
        for _ in range(3):
            sb.run(block)  # ExampleFailed unless it exits 0 with the document's output
            queues = sb.client().stats()["queues"]
            left = {name: {k: v for k, v in counts.items() if isinstance(v, int) and v}
                    for name, counts in queues.items()}
            assert not any(left.values()), left
