"""``bench/probes/drain_cpu.py`` runs end to end at a tiny size and drains every job; it
reports CPU per job, which no test times (the numbers belong in docs/performance.md; at
this size the service's CPU may round to one clock tick or none)."""
from bench.probes import drain_cpu


def test_the_drain_probe_drains_every_job_and_reports_cpu_per_job():
    fig = drain_cpu.measure(jobs=250, batch=100)   # three batches, the last one short
    assert (fig["jobs"], fig["batch"], fig["drained"]) == (250, 100, 250)
    assert fig["wall_us_per_job"] > 0
    assert fig["client_cpu_us_per_job"] >= 0 and fig["service_cpu_us_per_job"] >= 0
