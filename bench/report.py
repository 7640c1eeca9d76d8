"""The results as text: medians per figure and peer, ratios shardq/peer, delivery checks,
the machine's limits and shardq's fraction of each, figure Wk (worker runners), and the
issue's targets with met/missed.

Everything here reads the results dict that run.py builds (and writes as JSON); nothing here
measures.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from . import targets
from .physical import fsync_plus_rtt_per_s

THROUGHPUT = ["A", "B", "B-threads", "C", "C2", "D", "D2", "M"]
LATENCY = ["L@500", "L@5000"]
FIGURES = THROUGHPUT + LATENCY + ["W"]
DRAINS = ["C", "C2", "D", "D2", "M", "W"]  # figures whose deliveries are checked
MANY_CLIENTS = ["D", "D2", "M"]  # clients in processes, or threads where the peer needs it
A_BOUND_TARGET = 0.85  # issue 10: A >= 0.85 of 1/(fsync + pipe round trip)
SATURATED_BELOW = 0.95  # figure L: achieved under this fraction of the offered rate

TITLES = {
    "A": "A  enqueue, 1 producer, 1 job/call",
    "B": "B  enqueue, 1 producer, 100 jobs/call",
    "B-threads": "B-threads  enqueue, 16 threads, 1 job/call",
    "C": "C  drain, 1 consumer, lease+ack 1/call",
    "C2": "C2 drain, 1 consumer, lease+ack 100/call",
    "D": "D  2 prod + 2 cons, 1 job/call",
    "D2": "D2 2 prod + 2 cons, 100 jobs/call",
    "M": "M  16 prod + 4 cons, 1 job/call",
}

# shardq's figure -> (limit, jobs per unit of the limit, why). A job costs one round trip per
# call it needs and, if every call that changes state is fsynced on its own, one fsync each:
# with ``lease_sync = "batched"`` (the default) a lease is not one of them (the ack's fsync
# covers it), with "strict" it is.
def limits(lease_sync: str = "batched") -> dict[str, list[tuple[str, float, str]]]:
    lease = 1 if lease_sync == "strict" else 0  # fsyncs a lease pays of its own
    drain, mixed = 1 + lease, 2 + lease          # fsyncs per job: lease + ack; enqueue + lease + ack
    how = "strict leases" if lease else "batched leases"
    per_drain = f"{drain} fsync{'s' if drain > 1 else ''}"
    return {
        "A": [("fsync_per_s", 1, "1 fsync/job"), ("pipe_rtt_per_s", 1, "1 round trip/job")],
        "B": [("fsync_per_s", 100, "1 fsync/100 jobs"),
              ("pipe_batched_jobs_per_s", 1, "1 batched round trip/100 jobs")],
        "B-threads": [("fsync_per_s", 1, "1 fsync/job, no group commit"),
                      ("pipe_pipelined_msgs_per_s", 1, "1 message/job, many in flight")],
        "C": [("fsync_per_s", 1 / drain, f"lease + ack, {how}: {per_drain}/job"),
              ("pipe_rtt_per_s", 0.5, "2 round trips/job")],
        "C2": [("fsync_per_s", 100 / drain, f"{how}: {per_drain}/100 jobs"),
               ("pipe_batched_jobs_per_s", 0.5, "2 batched round trips/100 jobs")],
        "D": [("fsync_per_s", 1 / mixed, f"enqueue + lease + ack, {how}: {mixed} fsyncs/job, "
                                         "no group commit"),
              ("pipe_pipelined_msgs_per_s", 1 / 3, "3 messages/job")],
        "D2": [("fsync_per_s", 100 / mixed, f"{how}: {mixed} fsyncs/100 jobs"),
               ("pipe_batched_jobs_per_s", 1 / 3, "3 batched round trips/100 jobs")],
        "M": [("fsync_per_s", 1 / mixed, f"enqueue + lease + ack, {how}: {mixed} fsyncs/job, "
                                         "no group commit"),
              ("pipe_pipelined_msgs_per_s", 1 / 3, "3 messages/job")],
    }


LIMIT_NAMES = {
    "fsync_per_s": "fsync (100 B write + fsync)/s",
    "pipe_rtt_per_s": "Pipe round trips/s",
    "pipe_pipelined_msgs_per_s": "Pipe pipelined msgs/s (window 100)",
    "pipe_batched_jobs_per_s": "Pipe batched jobs/s (100 x 100 B msgpack)",
}


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def summarize(figure: str, runs: list[dict]) -> dict[str, Any]:
    """Medians over the runs that produced a result; errors and delivery checks kept."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"errors": [r["error"] for r in runs if "error" in r]}
    if figure in THROUGHPUT:
        out["jobs_per_s"] = _median([r["jobs_per_s"] for r in ok])
        if figure in MANY_CLIENTS:  # the two phases of the run (mpmc.phases)
            out["enqueue_per_s"] = _median([r.get("enqueue_per_s") for r in ok])
            out["drain_after_per_s"] = _median([r.get("drain_after_per_s") for r in ok])
    elif figure == "Wk":
        out["jobs_per_s"] = _median([r["jobs_per_s"] for r in ok])  # the drain rate
        out["enqueue_per_s"] = _median([r["enqueue_per_s"] for r in ok])
        out["stopped"] = sorted({r["stopped"] for r in ok if r["stopped"]})
    elif figure in LATENCY:
        for part in ("latency_ms", "call_ms"):
            for p in ("p50", "p99"):
                out[f"{part}_{p}"] = _median([r[part][p] for r in ok])
        out["achieved_per_s"] = _median([r["achieved_per_s"] for r in ok])
        out["offered_per_s"] = _median([r["offered_per_s"] for r in ok])
    elif figure == "W":
        out["wake_ms_p50"] = _median([r["wake_ms"]["p50"] for r in ok])
        out["wake_ms_p99"] = _median([r["wake_ms"]["p99"] for r in ok])
        out["idle_cpu_consumer"] = _median([r["idle_cpu_percent"]["consumer"] for r in ok])
        out["idle_cpu_server"] = _median([r["idle_cpu_percent"]["server"] for r in ok])
    checks = [r["delivery"] for r in ok if "delivery" in r]
    if checks:
        out["exactly_once"] = len(checks) == len(runs) and all(c["exactly_once"] for c in checks)
        out["duplicates"] = sum(c["duplicates"] for c in checks)
        out["missing"] = sum(c["missing"] for c in checks)
    modes = {r["mode"] for r in ok if "mode" in r}
    if modes:
        out["mode"] = "/".join(sorted(modes))
    return out


# ---------------------------------------------------------------- text

def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}{unit}"
    return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.1f}{unit}"


def _cell(peer: dict, figure: str, key: str, shardq_value: float | None, is_shardq: bool) -> str:
    fig = peer.get("figures", {}).get(figure)
    if peer.get("status") != "ok":
        return "skipped"
    if fig is None:
        return "-"
    if "na" in fig:
        return "n/a"
    summary = fig["summary"]
    value = summary.get(key)
    if value is None:
        return "error" if summary["errors"] else "-"
    text = _num(value)
    if summary["errors"]:
        text += "!"
    if key.startswith("latency_ms") and _saturated(summary):
        text += "*"
    if not is_shardq and shardq_value is not None and value:
        text += f" ({shardq_value / value:.2f}x)"
    return text


def _saturated(summary: dict) -> bool:
    """The producer fell behind the offered rate: latency then grows with the test's length."""
    return summary.get("achieved_per_s", 0) < SATURATED_BELOW * summary.get("offered_per_s", 0)


def _rows() -> list[tuple[str, str, str]]:
    rows = [(TITLES[f] + " [jobs/s]", f, "jobs_per_s") for f in THROUGHPUT]
    for f in MANY_CLIENTS:
        rows.append((f"{f}  while producing: enqueues [jobs/s]", f, "enqueue_per_s"))
        rows.append((f"{f}  after the producers: drain [jobs/s]", f, "drain_after_per_s"))
    for f in LATENCY:
        rate = f.split("@")[1]
        rows.append((f"{f} enqueue at {rate}/s, latency p50 [ms]", f, "latency_ms_p50"))
        rows.append((f"{f} enqueue at {rate}/s, latency p99 [ms]", f, "latency_ms_p99"))
        rows.append((f"{f} enqueue at {rate}/s, call p99 [ms]", f, "call_ms_p99"))
        rows.append((f"{f} achieved rate [jobs/s]", f, "achieved_per_s"))
    rows += [("W  idle wake-up p50 [ms]", "W", "wake_ms_p50"),
             ("W  idle wake-up p99 [ms]", "W", "wake_ms_p99"),
             ("W  idle CPU%, consumer", "W", "idle_cpu_consumer"),
             ("W  idle CPU%, server(s)", "W", "idle_cpu_server")]
    return rows


def _probe_row(peers: dict, names: list[str]) -> list[str]:
    """The disk's fsync rate just before each peer ran: context for its numbers."""
    row = ["fsync/s just before the peer ran (median)"]
    for n in names:
        probes = peers[n].get("fsync_probe_per_s") or []
        row.append(_num(statistics.median(probes)) if probes else "-")
    return row


def _grid(header: list[str], body: list[list[str]], left: int = 1) -> str:
    """A text table; the first ``left`` columns aligned left, the others right."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, *body]]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def figures_table(results: dict) -> str:
    peers = results["peers"]
    names = list(peers)
    shardq = peers.get("shardq", {})
    played = {f for p in peers.values() for f in p.get("figures", {})}
    body = []
    for title, figure, key in _rows():
        if figure not in played:
            continue
        sq = None
        if shardq.get("status") == "ok" and figure in shardq.get("figures", {}):
            sq = shardq["figures"][figure].get("summary", {}).get(key)
        body.append([title] + [_cell(peers[n], figure, key, sq, n == "shardq") for n in names])
    body.append(_probe_row(peers, names))
    return _grid(["figure (median)"] + names, body)


def delivery_table(results: dict) -> str:
    peers = results["peers"]
    names = list(peers)
    body = []
    played = {f for p in peers.values() for f in p.get("figures", {})}
    for figure in DRAINS:
        if figure not in played:
            continue
        row = [f"{figure}: exactly-once in effect"]
        for n in names:
            fig = peers[n].get("figures", {}).get(figure)
            if peers[n].get("status") != "ok":
                row.append("skipped")
            elif fig is None or "na" in fig:
                row.append("n/a")
            elif "exactly_once" not in fig["summary"]:
                row.append("error")
            else:
                s = fig["summary"]
                row.append("yes" if s["exactly_once"] else
                           f"NO (dup {s['duplicates']}, missing {s['missing']})")
        body.append(row)
    for figure in MANY_CLIENTS:
        if figure not in played:
            continue
        row = [f"{figure}: duplicate deliveries / client mode"]
        for n in names:
            s = peers[n].get("figures", {}).get(figure, {}).get("summary", {})
            row.append(f"{s['duplicates']} / {s.get('mode', '?')}" if "duplicates" in s else "-")
        body.append(row)
    return _grid(["delivery check"] + names, body)


def limits_text(results: dict) -> str:
    phys = results.get("physical") or {}
    runs = results.get("physical_runs") or []
    lines = [f"Physical limits (this machine, median of {len(runs)} measurement(s), [min-max]):"]
    for k, v in phys.items():
        spread = f"  [{_num(min(r[k] for r in runs))}-{_num(max(r[k] for r in runs))}]"
        lines.append(f"  {LIMIT_NAMES[k]:<44} {_num(v):>10}{spread if len(runs) > 1 else ''}")
    shardq = results["peers"].get("shardq", {})
    if shardq.get("status") != "ok" or not phys:
        return "\n".join(lines)
    lines.append("shardq as a fraction of the relevant limits:")
    for figure, figure_limits in limits((results.get("meta") or {}).get("shardq_lease_sync") or "batched").items():
        value = shardq["figures"].get(figure, {}).get("summary", {}).get("jobs_per_s")
        if value is None:
            continue
        parts = [f"{value / (phys[k] * per):.0%} of {k} ({why})" for k, per, why in figure_limits]
        lines.append(f"  {figure:<10}{_num(value):>10} jobs/s = " + "; ".join(parts))
    a = shardq["figures"].get("A", {}).get("summary", {}).get("jobs_per_s")
    bound = fsync_plus_rtt_per_s(phys)
    if a is not None and bound:
        lines.append(f"  A as a fraction of 1/(fsync + pipe round trip) = {_num(bound)}/s: "
                     f"{a / bound:.2f} (target >= {A_BOUND_TARGET})")
    return "\n".join(lines)



LEGEND = ("(x) = shardq / peer: above 1 shardq is faster on jobs/s rows, slower on ms rows;"
          " ! = some runs failed;\n* = the producer fell behind the offered rate (open loop), so"
          " that latency grows with the test's length: compare achieved rates instead")


def text(results: dict) -> str:
    peers = results["peers"]
    head = ["Peers (durability):"]
    for name, p in peers.items():
        state = p.get("durability", "") if p.get("status") == "ok" else f"skipped: {p['reason']}"
        head.append(f"  {name:<11} {state}")
    parts = []
    if peers:
        parts += ["\n".join(head), figures_table(results), LEGEND, delivery_table(results)]
    parts.append(limits_text(results))
    if results.get("wk"):
        parts.append(wk_table(results["wk"]))
    parts.append(targets_text(results))
    if results.get("scaling"):
        parts.append(scaling_text(results["scaling"]))
    return "\n\n".join(parts) + "\n"


def scaling_text(scaling: dict) -> str:
    if "skipped" in scaling:
        return f"S  scaling: skipped: {scaling['skipped']}"
    lines = []
    for mode, by_shards in scaling.items():
        threads = sorted({int(t) for row in by_shards.values() for t in row})
        body = [[f"{shards} shard(s)"] + [
            _num(row.get(str(t))) if isinstance(row.get(str(t)), float) else "error"
            for t in threads] for shards, row in by_shards.items()]
        lines.append(_grid([f"S  shardq enqueue {mode} [jobs/s]"] +
                           [f"{t} thr" for t in threads], body))
    return "\n\n".join(lines)


def wk_table(rows: dict) -> str:
    """Figure Wk: one line per runner@broker, shardq's drain rate against each."""
    ours = rows.get("shardq@shardq", {}).get("summary", {}).get("jobs_per_s")
    body = []
    for name, row in rows.items():
        if row["status"] != "ok":
            body.append([name, f"skipped: {row['reason']}", "", "", "", ""])
            continue
        s = row["summary"]
        drain = _num(s.get("jobs_per_s"))
        if s["errors"]:
            drain += "!"
        if ours and s.get("jobs_per_s") and not name.startswith("shardq@"):
            drain += f" ({ours / s['jobs_per_s']:.2f}x)"
        check = ("error" if "exactly_once" not in s else
                 "yes" if s["exactly_once"] else
                 f"NO (lost {s['missing']}, dup {s['duplicates']})")
        if s.get("stopped"):
            check += f"; drain stopped: {', '.join(s['stopped'])}"
        probes = row.get("fsync_probe_per_s") or []
        body.append([name, row.get("durability") or "?", _num(s.get("enqueue_per_s")), drain,
                     check, _num(statistics.median(probes)) if probes else "-"])
    lines = [_grid(["Wk  worker runner@broker", "durability", "enqueue [jobs/s]",
                    "drain [jobs/s]", "every job ran once", "fsync/s before"], body, left=2)]
    lines.append("(x) = shardq@shardq drain / this drain. Enqueue: one process, one call per "
                 "job; drain: the runner's worker,\n8 threads, one process, timed from the "
                 "first job's run to the last's; medians over the runs.")
    commands = {row["runner"]: row["command"] for row in rows.values()}
    lines += [f"  {runner:<12} {command}" for runner, command in commands.items()]
    return "\n".join(lines)


def targets_text(results: dict) -> str:
    lines = [_grid(["target (issue 10)", "measured in this run", "verdict"],
                   targets.rows(results), left=3)]
    lines.append("Not checked here: strict leases no slower than before (needs a run of the "
                 "old code to compare).")
    return "\n".join(lines)
