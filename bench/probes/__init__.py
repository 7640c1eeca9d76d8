"""Probes: one-question tools, each measuring one part of shardq (or one cost beside a
peer) to answer a question a figure of ``bench.run`` raised. Each is run on its own,
``python -m bench.probes.<name>``; bench/README.md ("Probes") lists the question each
answers. They reuse the harness's peers and workloads (``bench.peers``, ``bench.jobs``, ...),
never the other way round."""
