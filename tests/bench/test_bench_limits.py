"""The concurrency figure of ``bench/limits.py`` runs end to end at a tiny size: the most
leases the shard counted in flight is the cap, and the throughput is reported against the
cap's ideal. No timing is asserted: the numbers belong in docs/performance.md."""
from bench import limits


def test_the_concurrency_figure_holds_the_cap_and_reports_its_throughput():
    fig = limits.concurrency(shards=2, threads=8, cap=3, job_s=0.01, seconds=1.0)
    assert fig["max_in_flight_seen"] == 3
    assert fig["ideal_per_s"] == 300 and fig["jobs_per_s"] > 0
    assert fig["of_ideal"] == round(fig["jobs_per_s"] / 300, 3)
