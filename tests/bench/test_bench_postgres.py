"""bench/postgres.py runs end to end in quick mode against the tests' PostgreSQL, and every
effect and outbox row arrives exactly once. No timing is asserted."""
import json
import subprocess
import sys

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from support.service import REPO


def test_quick_postgres_benchmark_runs(pg_dsn, tmp_path):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    out = tmp_path / "postgres.json"
    proc = subprocess.run([sys.executable, "-m", "bench.postgres", "--quick", "--dsn", pg_dsn,
                           "--jobs", "100", "--rows", "300", "--latency-rows", "30",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True
    assert {"drain_postgres", "drain_sqlite", "outbox_latency", "outbox_throughput"} <= set(result)
    assert result["outbox_latency"]["latency_ms"]["p99"] >= result["outbox_latency"]["latency_ms"]["p50"]
