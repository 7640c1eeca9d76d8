"""Side-by-side throughput benchmark: shardq against real peers at their real durability.

Layout (one job per module):

* ``peers/base.py``      the interface every peer implements (``Adapter``, ``Client``), and
                         ``connect(spec)`` for clients in other processes
* ``peers/servers.py``   start/stop a peer server by PID on 127.0.0.1; install missing binaries
* ``peers/{beanstalkd,redis_peer,persistq,shardq_peer}.py``  one adapter each
  (``peers/beanstalk_proto.py`` is the minimal beanstalkd protocol client)
* ``jobs.py``            the workload's bodies and keys, and the exactly-once delivery check
* ``physical.py``        limits of this machine measured in the same run (fsync, pipes)
* ``plan.py``            sizes (full, quick) and the figure groups each peer plays per run
* ``workloads.py``       figures A, B, B-threads, C, C2 (one client, in-process)
* ``mpmc.py``            figures D, D2 (2 producers + 2 consumers) and M (16 + 4), processes
                         or threads
* ``latency.py``         figures L (paced enqueue latency) and W (idle wake-up)
* ``scaling.py``         figure S (shardq only: shards x producer threads)
* ``workers/``           figure Wk: each framework's own worker runner draining no-op jobs
* ``report.py``          the table printed at the end; ``targets.py`` the issue's targets, met
                         or missed; ``run.py`` the entry point; ``plot.py`` PNGs

Figures run on their own, beside ``run.py``: ``aio.py`` (the asyncio client against the
threaded router), ``postgres.py`` (figures P1-P3), ``scale_procs.py`` (producer processes x
shards). ``probes/`` holds one-question tools (bench/README.md, "Probes"), each measuring one
part of shardq; they import the harness, never the other way round.

Timestamps are ``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every process on
the machine, so a producer's and a consumer's readings can be compared.
"""
