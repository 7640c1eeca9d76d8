"""bench.pairs runs two source trees in ABBA order and reports new ÷ old per figure. Here
both trees are this checkout, at a tiny size: the harness runs end to end, each run measures
every figure asked, and each ratio is the quotient of the two runs' own figures. No timing
is asserted (docs/performance.md holds the figures). Each run is ``bench.run --quick`` (an
option bench.pairs passes on): its physical limits take 0.2 s each instead of 1 s."""
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pairs_run_both_trees_in_abba_order_and_report_each_ratio(tmp_path):
    out = tmp_path / "pairs.json"
    r = subprocess.run([sys.executable, "-m", "bench.pairs", "--old", REPO, "--new", REPO, "--pairs", "2",
                        "--figures", "A", "--jobs", "100", "--json", str(out), "--quick"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [list(run) for run in res["runs"]] == [["old", "new"], ["new", "old"]]  # A B, B A
    ratios: dict[str, list[float]] = {"A": []}
    for run in res["runs"]:
        for fig in ("A",):
            assert run["old"][fig] > 0 and run["new"][fig] > 0
            ratios[fig].append(run["new"][fig] / run["old"][fig])
    for fig, rs in ratios.items():
        s = res["summary"][fig]
        assert s["pairs"] == 2 and s["min"] == min(rs) and s["max"] == max(rs)
        assert math.isclose(s["geomean"], math.sqrt(rs[0] * rs[1]))
        assert f"{fig}: new/old {s['geomean']:.3f}" in r.stdout


def test_a_run_of_figure_wk_alone_gives_one_ratio_name_per_worker_runner(monkeypatch):
    """Figure Wk's results live under ``wk`` (one row per runner@broker), not under
    ``peers.shardq``, which a run of Wk alone does not have: run_once used to raise
    KeyError: 'shardq' there. bench.run is stood in for by what it writes."""
    from bench import pairs

    wk_only = {"peers": {}, "wk": {
        "shardq@shardq": {"status": "ok", "summary": {"jobs_per_s": 1500.0, "errors": []}},
        "shardq-idem@shardq": {"status": "ok", "summary": {"jobs_per_s": 900.0, "errors": []}},
        "celery@redis-always": {"status": "skipped", "summary": {"jobs_per_s": None, "errors": ["x"]}}}}
    both = {"peers": {"shardq": {"figures": {"A": {"summary": {"jobs_per_s": 4000.0}},
                                             "M": {"summary": {"jobs_per_s": None}}}}},
            "wk": {"shardq@shardq": {"status": "ok", "summary": {"jobs_per_s": 1200.0}}}}
    seen = []

    def fake_run(argv, **kw):
        seen.append(argv[argv.index("--figures") + 1])
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(wk_only if seen[-1] == "Wk" else both, f)

    monkeypatch.setattr(pairs.subprocess, "run", fake_run)
    assert pairs.run_once(REPO, "Wk", 100, ["--runners", "shardq"]) == {
        "Wk shardq@shardq": 1500.0, "Wk shardq-idem@shardq": 900.0}
    assert pairs.run_once(REPO, "A,M,Wk", 100, []) == {"A": 4000.0, "Wk shardq@shardq": 1200.0}
    assert seen == ["Wk", "A,M,Wk"]


def test_figure_aio_runs_bench_aio_of_the_tree_and_names_a_ratio_per_row(monkeypatch):
    """``--figures aio`` runs ``bench.aio`` (not ``bench.run``), with the tree first on
    PYTHONPATH, and names each of its rows; the other figures still go to ``bench.run``."""
    from bench import pairs

    aio = {"figures": {"produce/asyncio": {"jobs_per_s": 9000}, "drain/threads": {"jobs_per_s": 4000}}}
    run = {"peers": {"shardq": {"figures": {"A": {"summary": {"jobs_per_s": 4000.0}}}}}}
    seen = []

    def fake_run(argv, **kw):
        seen.append((argv[2], kw["env"]["PYTHONPATH"]))
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(aio if argv[2] == "bench.aio" else run, f)

    monkeypatch.setattr(pairs.subprocess, "run", fake_run)
    assert pairs.run_once(REPO, "aio", 100, []) == {"aio produce/asyncio": 9000, "aio drain/threads": 4000}
    assert pairs.run_once(REPO, "A,aio", 100, []) == {"A": 4000.0, "aio produce/asyncio": 9000,
                                                       "aio drain/threads": 4000}
    assert seen == [("bench.aio", REPO), ("bench.aio", REPO), ("bench.run", REPO)]
