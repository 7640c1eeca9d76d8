"""``Retry(delay_s=...)`` that is no number of seconds: ``raise shardq.Retry(delay_s="30s")``
in a task made the worker's settle path die (``float("30s")`` in Policy.settle), the worker
ended with its leases in flight, and the jobs it had finished but not acked ran again when
their leases expired, again and again. Now Retry refuses such a delay when it is made (the
task fails as with any error of its own), and the settle path never dies of one (a delay
set on a Retry afterwards fails that attempt alone)."""
from __future__ import annotations

import decimal
import fractions
import math
import pickle

import pytest

import shardq
from shardq.consumer.handling import FAILED, RETRY
from shardq.consumer.policy import NACK, Policy, Settle
from shardq.types import Lease


@pytest.mark.parametrize("delay, error, words", [
    ("30s", TypeError, "delay_s must be a number of seconds or None, got str '30s'"),
    (b"30", TypeError, "delay_s must be a number"),
    (True, TypeError, "got bool True"),
    ([30], TypeError, "got list"),
    (-1, ValueError, "delay_s must be a finite number of seconds >= 0, got -1"),
    (-0.5, ValueError, "delay_s must be a finite"),
    (math.nan, ValueError, "got nan"),
    (math.inf, ValueError, "got inf"),
    (decimal.Decimal("sNaN"), ValueError, "delay_s must be a finite"),
    pytest.param(10**400, ValueError, r"delay_s must be a finite number of seconds >= 0, got 1000.*\.\.\.$",
                 id="an-int-past-float"),
])
def test_retry_refuses_a_delay_that_is_no_number_of_seconds(delay, error, words):
    with pytest.raises(error, match=words):
        shardq.Retry(delay_s=delay)


@pytest.mark.parametrize("delay", [None, 0, 0.0, 30, 2.5, 10**9, fractions.Fraction(1, 2), decimal.Decimal("1.5")])
def test_retry_takes_a_number_of_seconds_or_none(delay):
    r = shardq.Retry(delay_s=delay, reason="later")
    assert r.delay_s == delay and r.reason == "later" and str(r) == "later"


@pytest.mark.parametrize("r", [shardq.Retry(), shardq.Retry(30), shardq.Retry(2.5, "busy")])
def test_a_retry_pickles_as_it_was(r):
    """Pickle made an exception again from its ``args`` (the message), which Retry took as
    ``delay_s``; with the check that would refuse every unpickled Retry."""
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(r, protocol))
        assert (type(again), again.args, again.delay_s, again.reason) == (type(r), r.args, r.delay_s, r.reason)


def lease(attempt: int) -> Lease:
    return Lease(7, None, b"", "default", attempt, 1, 100.0)


class TopRng:
    def uniform(self, a, b):
        return b


@pytest.mark.parametrize("delay", ["30s", b"30", True, math.nan, object()])
def test_the_settle_path_fails_that_run_alone_for_a_delay_that_is_no_number(delay, caplog):
    p = Policy(backoff_base_s=1.0, backoff_cap_s=10.0, rng=TopRng())
    p.configure({"visibility_timeout": 30, "max_deliveries": 4})
    settle = p.settle(RETRY, "busy\nTraceback ...", delay, lease(2), lost=False)
    assert settle.op == NACK and settle.delay_s == 2.0                     # the backoff, as any failure
    first, rest = settle.error.split("\n", 1)
    assert first.startswith("busy (Retry's delay_s ")
    assert first.endswith("is not a number of seconds: retried as a failure)")
    assert rest == "Traceback ..."
    assert "is not a number of seconds" in caplog.text
    last = p.settle(RETRY, "busy", delay, lease(4), lost=False)           # its last delivery
    assert last.op == NACK and last.delay_s == 0.0
    assert p.settle(FAILED, "E: x", None, lease(2), lost=False) == Settle(NACK, "failed", 2.0, "E: x")


class TopBackoff(shardq.Exponential):
    """The top of the full jitter: an hour, so the job is not due again while the test runs."""

    def delay(self, attempt, rng):
        return min(self.cap_s, self.base_s * 2.0 ** (attempt - 1))


@pytest.fixture
def app():
    a = shardq.App.embedded(config={"queue_defaults": {"max_deliveries": 5}})
    yield a
    a.close()


def test_a_task_raising_retry_with_a_str_delay_fails_alone_and_the_worker_goes_on(app):
    ran: list[int] = []

    @app.task(queue="t-retry-str", name="flaky", backoff=TopBackoff(3600, 3600))
    def flaky(ctx) -> None:
        raise shardq.Retry(delay_s="30s")        # a str, e.g. read from a config or a header

    @app.task(queue="t-retry-str", name="other")
    def other(ctx, n: int) -> None:
        ran.append(n)

    job = flaky.send()
    others = [other.send(n) for n in range(3)]
    app.run_worker("t-retry-str", idle_wait_s=0.05, poll_s=0.01)     # returns: the worker lived
    assert sorted(ran) == [0, 1, 2]
    assert all(app.status(j)["state"] == "gone" for j in others)         # acked, no result kept
    status = app.status(job)
    assert status["state"] == "delayed" and status["attempts"] == 1, status   # waits out its backoff
    assert status["error"].startswith("TypeError: Retry: delay_s must be a number of seconds or None, got str '30s'")
    stats = app.queue.stats()["queues"]["t-retry-str"]
    assert (stats["ready"], stats["in_flight"], stats["delayed"]) == (0, 0, 1)


def test_a_delay_set_on_a_retry_afterwards_fails_that_run_alone(app):
    @app.task(queue="t-retry-set", name="sneaky")
    def sneaky(ctx) -> None:
        r = shardq.Retry(30, "busy")
        r.delay_s = "30s"                         # past the check: the settle path meets it
        raise r

    job = sneaky.send()
    app.run_worker("t-retry-set", idle_wait_s=0.05, poll_s=0.01, rng=TopRng(), backoff_base_s=3600.0,
                   backoff_cap_s=3600.0)
    status = app.status(job)
    assert status["state"] == "delayed" and status["attempts"] == 1, status
    assert status["error"].startswith("busy (Retry's delay_s '30s' is not a number of seconds: retried as a failure)")
    assert app.queue.stats()["queues"]["t-retry-set"]["in_flight"] == 0
