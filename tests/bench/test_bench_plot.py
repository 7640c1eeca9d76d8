"""bench/plot.py's latency.png (figures L@500 and W, one line per peer) and the thinned CDFs
bench.run keeps for it (bench/latency.py ``cdf_us``). No timing is asserted."""
import pytest

from bench.latency import CDF_POINTS_MAX, cdf_us


def test_a_cdf_keeps_at_most_its_points_with_the_fastest_and_the_slowest():
    seconds = [i / 1e6 for i in range(10 * CDF_POINTS_MAX, 0, -1)]  # 1 us .. 5 ms, unsorted
    cdf = cdf_us(seconds)
    assert len(cdf) == CDF_POINTS_MAX and cdf == sorted(cdf)
    assert (cdf[0], cdf[-1]) == (1.0, 10.0 * CDF_POINTS_MAX)
    assert cdf_us([0.002, 0.001]) == [1000.0, 2000.0]  # few samples: all kept


def test_latency_png_draws_every_peer_that_has_samples(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plot import plot_latency
    run = {"latency_cdf_us": [200.0, 300.0, 900.0], "wake_cdf_us": [400.0, 500.0, 2000.0]}
    peers = {"shardq": {"figures": {"L@500": {"runs": [run]}, "W": {"runs": [run, run]}}},
             "skipped": {"status": "skipped"}}
    path = tmp_path / "latency.png"
    assert plot_latency(peers, str(path)) and path.stat().st_size > 1000
    assert not plot_latency({"skipped": {"status": "skipped"}}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def test_a_run_of_latency_figures_only_gets_latency_png_and_no_empty_throughput_png(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from bench.plot import main
    run = {"latency_cdf_us": [200.0, 300.0], "wake_cdf_us": [400.0, 500.0]}
    figures = {"L@500": {"runs": [run], "summary": {}}, "W": {"runs": [run], "summary": {}}}
    path = tmp_path / "lw.json"
    path.write_text(json.dumps({"peers": {"shardq": {"status": "ok", "figures": figures}}}))
    assert main([str(path)]) == 0
    assert (tmp_path / "latency.png").exists() and not (tmp_path / "throughput.png").exists()
