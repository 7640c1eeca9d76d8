"""The targets of issue 10, checked against one run's results: each is a ratio measured in
that run (shardq against a peer, a framework or the machine's limits) or a latency, with
its threshold. Nothing here measures; report.py prints the table (met / missed by how much /
not measured when the run lacks a figure or a peer).

Not checked here: "``strict`` leases no slower than today on every figure", which needs a
run of the code before the change to compare with.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .physical import fsync_plus_rtt_per_s

Measured = tuple[float | None, str]  # (value, what it was measured against)


@dataclass(frozen=True)
class Target:
    label: str
    measure: Callable[[dict], Measured]
    threshold: float
    higher_is_better: bool = True
    unit: str = "x"

    def check(self, results: dict) -> tuple[str, str]:
        """(measured, verdict) as text."""
        value, against = self.measure(results)
        if value is None:
            return "-", f"not measured ({against})" if against else "not measured"
        shown = f"{value:.2f}{self.unit}" + (f" ({against})" if against else "")
        ok = value >= self.threshold if self.higher_is_better else value <= self.threshold
        if ok:
            return shown, "met"
        gap = abs(value - self.threshold) / self.threshold
        return shown, f"MISSED by {gap:.0%}"


def _summary(results: dict, peer: str, figure: str) -> dict:
    p = results.get("peers", {}).get(peer, {})
    if p.get("status") != "ok":
        return {}
    return p.get("figures", {}).get(figure, {}).get("summary", {})


def _ratio_to(peer: str, figure: str) -> Callable[[dict], Measured]:
    def measure(results: dict) -> Measured:
        ours = _summary(results, "shardq", figure).get("jobs_per_s")
        theirs = _summary(results, peer, figure).get("jobs_per_s")
        if not ours or not theirs:
            return None, f"no {figure} for shardq and {peer}"
        return ours / theirs, f"{ours:,.0f} / {theirs:,.0f} jobs/s"
    return measure


def _against_best(ours: float | None, rates: dict[str, float | None], best_is: str,
                  missing: str) -> Measured:
    """``ours`` divided by the highest of ``rates`` (None values ignored)."""
    rates = {n: v for n, v in rates.items() if v}
    if not ours or not rates:
        return None, missing
    best = max(rates, key=rates.__getitem__)
    return ours / rates[best], f"{best_is} {best}, {rates[best]:,.0f} jobs/s"


def _ratio_to_best(figure: str) -> Callable[[dict], Measured]:
    def measure(results: dict) -> Measured:
        rates = {n: _summary(results, n, figure).get("jobs_per_s")
                 for n in results.get("peers", {}) if n != "shardq"}
        return _against_best(_summary(results, "shardq", figure).get("jobs_per_s"), rates,
                             "best peer", f"no {figure} for shardq and a peer")
    return measure


def _latency(figure: str, key: str) -> Callable[[dict], Measured]:
    def measure(results: dict) -> Measured:
        return _summary(results, "shardq", figure).get(key), ""
    return measure


def _a_of_bound(results: dict) -> Measured:
    ours = _summary(results, "shardq", "A").get("jobs_per_s")
    bound = fsync_plus_rtt_per_s(results.get("physical") or {})
    if not ours or not bound:
        return None, "no A or no physical limits"
    return ours / bound, f"1/(fsync + pipe round trip) = {bound:,.0f}/s"


def _wk_ratio(broker: str) -> Callable[[dict], Measured]:
    def measure(results: dict) -> Measured:
        rows = results.get("wk") or {}
        rates = {n: r.get("summary", {}).get("jobs_per_s") for n, r in rows.items()
                 if r.get("broker") == broker and r.get("status") == "ok"}
        ours = rows.get("shardq@shardq", {}).get("summary", {}).get("jobs_per_s")
        return _against_best(ours, rates, "fastest",
                             f"no Wk for shardq and a runner on {broker}")
    return measure


TARGETS = (
    Target("A >= 1.0x Redis", _ratio_to("redis", "A"), 1.0),
    Target("A >= 0.9x beanstalkd", _ratio_to("beanstalkd", "A"), 0.9),
    Target("A >= 0.85 of 1/(fsync + pipe round trip)", _a_of_bound, 0.85, unit=""),
    Target("C >= 1.0x beanstalkd", _ratio_to("beanstalkd", "C"), 1.0),
    Target("D >= 1.0x the best peer", _ratio_to_best("D"), 1.0),
    Target("M >= 1.5x the best peer", _ratio_to_best("M"), 1.5),
    Target("W p99 <= 1.0 ms", _latency("W", "wake_ms_p99"), 1.0, False, " ms"),
    Target("L p99 at 500/s <= 0.6 ms", _latency("L@500", "latency_ms_p99"), 0.6, False, " ms"),
    Target("B >= 1.5x Redis", _ratio_to("redis", "B"), 1.5),
    Target("C2 >= 1.5x Redis", _ratio_to("redis", "C2"), 1.5),
    Target("D2 >= 1.5x Redis", _ratio_to("redis", "D2"), 1.5),
    Target("Wk >= 2x the fastest runner on Redis always", _wk_ratio("redis-always"), 2.0),
    Target("Wk >= 1x the fastest runner on Redis default", _wk_ratio("redis-default"), 1.0),
)


def rows(results: dict) -> list[list[str]]:
    """[target, measured, verdict] for each target."""
    return [[t.label, *t.check(results)] for t in TARGETS]
