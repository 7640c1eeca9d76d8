"""One module per framework: its app as a user would write it, the no-op task, and
``enqueue_all(ids)``, which enqueues one job per id with the framework's one-job call.

Each module is imported only in a child process (the enqueueing process or the framework's
worker), which finds its broker in the environment variables named here, set by
``bench.workers.brokers``. Every no-op task does the same one thing: ``record(job_id)``.
"""
REDIS_URL_ENV = "BENCH_WK_REDIS_URL"        # redis://127.0.0.1:<port>/0
SHARDQ_DIR_ENV = "BENCH_WK_SHARDQ_DIR"      # the data dir of a running `shardq serve`
HUEY_SQLITE_ENV = "BENCH_WK_HUEY_SQLITE"    # set: Huey on this SQLite file, else on Redis
