"""PNG plots from a results JSON: ``python -m bench.plot [results.json] [--out DIR]``.

* ``scaling.png``: shardq enqueue jobs/s against producer threads, one line per shard count,
  unbatched and batched side by side (figure S; only if the JSON has it).
* ``throughput.png``: the median jobs/s of figures A-M, one bar per peer.
* ``wk.png``: figure Wk, the median enqueue and drain rates of each runner@broker row.
* ``latency.png``: figures L at 500/s and W, one line per peer (every run's samples
  together): the share of calls slower than each latency, on log scales, so the tail
  shows, not only p50 and p99.
* ``<name>.png`` from a ``bench.scale_procs`` JSON ``<name>.json`` (it has ``"cells"``;
  ``scale16.png`` beside ``scale16.json``): jobs/s against producer processes, one line per
  shard count.

Without a path it reads ``bench/results/latest.json``, which ``python -m bench.run`` writes
unless given ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from .report import THROUGHPUT  # noqa: E402 - after choosing the backend

DEFAULT_JSON = os.path.join(os.path.dirname(__file__), "results", "latest.json")


def plot_scaling(scaling: dict, path: str) -> bool:
    modes = {m: rows for m, rows in scaling.items() if isinstance(rows, dict) and rows}
    if not modes:
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, (mode, by_shards) in zip(axes[0], modes.items()):
        for shards, row in sorted(by_shards.items(), key=lambda kv: int(kv[0])):
            points = sorted((int(t), v) for t, v in row.items() if isinstance(v, (int, float)))
            if points:
                ax.plot([t for t, _ in points], [v for _, v in points], marker="o",
                        label=f"{shards} shard(s)")
        _log2_axes(ax, [1, 4, 16], "producer threads (one router)", "jobs/s", f"shardq enqueue, {mode}")
    _save(fig, path)
    return True


def _log2_axes(ax, ticks: list[int], xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(peers: dict, path: str) -> bool:
    def rate(name: str, figure: str) -> float:
        return (peers[name]["figures"].get(figure, {}).get("summary") or {}).get("jobs_per_s") or float("nan")

    names = [n for n, p in peers.items() if p.get("status") == "ok"]
    if not any(rate(n, f) > 0 for n in names for f in THROUGHPUT):
        return False  # a run of latency figures only (L, W): no bar to draw
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [rate(name, f) for f in THROUGHPUT]
        ax.bar([x + i * width for x in range(len(THROUGHPUT))], values, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(THROUGHPUT))],
                  labels=THROUGHPUT)
    ax.set_yscale("log")
    ax.set_ylabel("jobs/s (median, log scale)")
    ax.set_title("Throughput at each peer's durable setting (missing bar: n/a or failed)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_wk(rows: dict, path: str) -> bool:
    ran = {n: r["summary"] for n, r in rows.items()
           if r.get("status") == "ok" and r.get("summary", {}).get("jobs_per_s")}
    if not ran:
        return False
    names = list(ran)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ran[n].get("enqueue_per_s") or 0 for n in names], 0.4,
           label="enqueue (1 process, 1 call/job)")
    ax.bar([x + 0.2 for x in xs], [ran[n]["jobs_per_s"] for n in names], 0.4,
           label="drain (the runner's worker, 8 threads)")
    ax.set_xticks(list(xs), labels=names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("no-op jobs/s (median, log scale)")
    ax.set_title("Wk: worker runners")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    _save(fig, path)
    return True


#: latency.png's panels: (figure, the runs' key with the CDF, title)
LATENCY_PANELS = (("L@500", "latency_cdf_us", "L: enqueue at 500/s, from its due time"),
                  ("W", "wake_cdf_us", "W: enqueue to the waiting consumer's lease"))


def plot_latency(peers: dict, path: str) -> bool:
    """Complementary CDFs of figures L@500 and W, one line per peer."""
    drawn = False
    fig, axes = plt.subplots(1, len(LATENCY_PANELS), figsize=(6 * len(LATENCY_PANELS), 4.5), squeeze=False)
    for ax, (figure, key, title) in zip(axes[0], LATENCY_PANELS):
        lines = 0
        for name, peer in peers.items():
            runs = ((peer.get("figures") or {}).get(figure) or {}).get("runs") or []
            xs = sorted(x for r in runs for x in r.get(key) or [])
            if not xs:
                continue
            n = len(xs)
            ax.step([x / 1e3 for x in xs], [(n - i) / n for i in range(n)], where="post", label=name)
            lines += 1
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1 / 1000, 1.05)
        ax.axhline(0.01, color="grey", lw=0.8, ls=":")  # p99
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")   # p50
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("share of calls slower (log scale)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        if lines:  # (a panel no peer has samples for stays empty, with no legend)
            ax.legend()
            drawn = True
    if drawn:
        _save(fig, path)
    else:
        plt.close(fig)
    return drawn


def plot_scale_procs(data: dict, path: str) -> bool:
    cells = data.get("cells") or []
    modes = sorted({c["mode"] for c in cells})
    if not modes:
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for shards in sorted({c["shards"] for c in cells}):
            pts = sorted((c["producers"], c["jobs_per_s"]) for c in cells
                         if c["mode"] == mode and c["shards"] == shards)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"{shards} shard(s)")
        _log2_axes(ax, sorted({c["producers"] for c in cells}), "producer processes",
                   "durable enqueues/s", f"{mode} enqueue, {data.get('cpus', '?')} CPUs")
    _save(fig, path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot")
    p.add_argument("json", nargs="?", default=DEFAULT_JSON)
    p.add_argument("--out", default=None, help="directory for the PNGs (default: beside JSON)")
    args = p.parse_args(argv)
    try:
        with open(args.json) as f:
            results = json.load(f)
    except FileNotFoundError:
        print(f"error: no results at {args.json}: run `python -m bench.run` first (it writes them there), "
              "or name a results JSON", file=sys.stderr)
        return 2
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out, exist_ok=True)
    if "cells" in results:
        name = os.path.splitext(os.path.basename(args.json))[0] + ".png"
        if plot_scale_procs(results, os.path.join(out, name)):
            print(os.path.join(out, name))
        return 0
    made = []
    if plot_scaling(results.get("scaling") or {}, os.path.join(out, "scaling.png")):
        made.append("scaling.png")
    else:
        print("no scaling results (figure S) in the JSON; scaling.png not made", file=sys.stderr)
    if plot_throughput(results.get("peers", {}), os.path.join(out, "throughput.png")):
        made.append("throughput.png")
    if plot_wk(results.get("wk") or {}, os.path.join(out, "wk.png")):
        made.append("wk.png")
    if plot_latency(results.get("peers", {}), os.path.join(out, "latency.png")):
        made.append("latency.png")
    for name in made:
        print(os.path.join(out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
