"""Figure Wk: the standard worker runner of each framework, draining no-op jobs.

Per runner and run: start its broker fresh (Redis at one persistence setting, ``shardq
serve``, or a SQLite file), enqueue ``wk_jobs`` no-op jobs from one process with one call
each (timed: the enqueue rate), then start the framework's own worker command with 8
threads in one process and time it draining them (the drain rate). Every run of the no-op
task is recorded (``record.py``), so lost and duplicated runs are counted.

* ``record.py``   the no-op's record of having run, and the harness's reader of it
* ``apps/``       one module per framework: its app, the no-op task, and ``enqueue_all``
* ``runners.py``  the runners: worker command lines and the brokers each is run on
* ``brokers.py``  starting and stopping a runner's broker; the environment the app reads
* ``enqueue.py``  the enqueueing process (``python -m bench.workers.enqueue``)
* ``figure.py``   one runner, one run: enqueue, drain, check
"""
