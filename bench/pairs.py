"""Two builds of shardq, measured in ABBA pairs in one run: ``new ÷ old`` per figure.

On a shared VM a figure moves 10-30% from run to run; a ratio of two builds measured one
right after the other (A B B A, so that a drift in the machine falls on both) moves far
less. Each side is a source tree (a checkout or ``git worktree add /tmp/old COMMIT``); each
run is ``python -m bench.run --only shardq`` with that tree first on ``PYTHONPATH``, so the
tree's own shardq, and the shard processes it starts (``child_env``), are the ones measured::

    git worktree add /tmp/old f411784
    python -m bench.pairs --old /tmp/old --new . --pairs 4 --figures A,C,C2,M --jobs 5000

It prints and writes (``--json``) each pair's ratios and their geometric mean per figure;
figure Wk gives one ratio per worker runner (``--figures Wk --runners shardq``: ``Wk shardq@shardq``);
figure ``aio`` runs ``python -m bench.aio`` (the asyncio client beside the threaded router) and
gives one ratio per row of it (``aio produce/asyncio``, ``aio drain/threads``, ...).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile


def run_once(tree: str, figures: str, jobs: int, extra: list[str]) -> dict[str, float]:
    """One ``bench.run`` of ``tree``: jobs/s per figure (:func:`figures_of`); figure ``aio``
    by one ``bench.aio`` run (:func:`aio_once`)."""
    names = figures.split(",")
    out = aio_once(tree, jobs) if "aio" in names else {}
    rest = ",".join(n for n in names if n != "aio")
    return {**run_figures(tree, rest, jobs, extra), **out} if rest else out


def aio_once(tree: str, jobs: int) -> dict[str, float]:
    """One ``bench.aio`` run of ``tree``: jobs/s per row, named ``aio <figure>/<client>``."""
    with tempfile.TemporaryDirectory(prefix="sqpairs") as tmp:
        out = os.path.join(tmp, "aio.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        subprocess.run([sys.executable, "-m", "bench.aio", "--jobs", str(jobs), "--json", out],
                       cwd=os.path.abspath(tree), env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            rows = json.load(f)["figures"]
        return {f"aio {name}": row["jobs_per_s"] for name, row in rows.items()}


def run_figures(tree: str, figures: str, jobs: int, extra: list[str]) -> dict[str, float]:
    """One ``bench.run`` of ``tree`` for ``figures``."""
    with tempfile.TemporaryDirectory(prefix="sqpairs") as tmp:
        out = os.path.join(tmp, "r.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        subprocess.run([sys.executable, "-m", "bench.run", "--only", "shardq", "--figures", figures,
                        "--jobs", str(jobs), "--runs", "1", "--no-scaling", "--no-install", "--json", out,
                        *extra], cwd=os.path.abspath(tree), env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            return figures_of(json.load(f))


def figures_of(results: dict) -> dict[str, float]:
    """jobs/s per figure of one ``bench.run`` result: shardq's figures (``peers.shardq``,
    absent when only Wk ran) and figure Wk, one per worker runner (``wk``, keyed
    ``runner@broker``), named ``Wk runner@broker``."""
    out: dict[str, float] = {}
    shardq = results.get("peers", {}).get("shardq", {})
    for name, fig in shardq.get("figures", {}).items():
        if fig.get("summary", {}).get("jobs_per_s"):
            out[name] = fig["summary"]["jobs_per_s"]
    for variant, row in results.get("wk", {}).items():
        if row.get("summary", {}).get("jobs_per_s"):
            out[f"Wk {variant}"] = row["summary"]["jobs_per_s"]
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pairs", description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the old build's source tree")
    p.add_argument("--new", default=".", help="the new build's source tree (default: this one)")
    p.add_argument("--pairs", type=int, default=4, help="ABBA pairs (default 4)")
    p.add_argument("--figures", default="A,C,C2,M")
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--json", help="write every run and the ratios here")
    a, extra = p.parse_known_args(argv)
    runs: list[dict] = []
    ratios: dict[str, list[float]] = {}
    for i in range(a.pairs):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")  # A B, then B A
        got = {side: run_once(getattr(a, side), a.figures, a.jobs, extra) for side in order}
        runs.append(got)
        line = []
        for fig, new in got["new"].items():
            old = got["old"].get(fig)
            if old:
                ratios.setdefault(fig, []).append(new / old)
                line.append(f"{fig} {new / old:.3f}")
        print(f"pair {i + 1} ({'-'.join(order)}): " + ", ".join(line), flush=True)
    summary = {fig: {"geomean": geomean(rs), "min": min(rs), "max": max(rs), "pairs": len(rs)}
               for fig, rs in ratios.items()}
    for fig, s in summary.items():
        print(f"{fig}: new/old {s['geomean']:.3f} (pairs {s['min']:.2f}-{s['max']:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
