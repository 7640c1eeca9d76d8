"""Flat combining of single calls (shardq/client/combine.py): rounds carry what waited,
each caller gets its own item's outcome, the lead is handed on, and no caller is stranded.
The scenarios that queue callers behind a round hold one round out at a time (``leaders=1``);
the crowd runs with one and with two."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from shardq.client import combine
from shardq.client.channel import MERGE_BYTES_MAX
from shardq.client.combine import Combiner
from shardq.errors import ShardUnavailable
from support.service import wait_until


class Gate:
    """A ``send`` that holds its first round until ``n`` callers wait behind it; records
    every round's items and answers each item doubled (or an error for ``"bad"``)."""

    def __init__(self, n: int) -> None:
        self.n, self.rounds, self.comb = n, [], None

    def __call__(self, items):
        if not self.rounds:
            wait_until(lambda: len(self.comb._waiting) >= self.n, 10, what=f"{self.n} callers waiting")
        self.rounds.append(list(items))
        return [ValueError(i) if i == "bad" else i * 2 for i in items]


def run_callers(comb, items):
    out: dict = {}

    def one(item):
        try:
            out[item] = comb.call(item)
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            out[item] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in items]
    for t in threads:
        t.start()
    return threads, out


def test_callers_waiting_behind_a_round_go_in_the_next_one_each_with_its_own_outcome():
    gate = Gate(5)
    comb = gate.comb = Combiner(gate, leaders=1)
    threads, out = run_callers(comb, [1])
    wait_until(lambda: gate.rounds or comb._leaders, 5, what="the first round under way")
    more, out2 = run_callers(comb, [2, 3, "bad", 5, 6])
    for t in [*threads, *more]:
        t.join(10)
    assert gate.rounds[0] == [1] and sorted(map(str, gate.rounds[1])) == ["2", "3", "5", "6", "bad"]
    assert comb.rounds == 2 and comb._leaders == 0 and not comb._waiting
    assert out == {1: 2} and {k: v for k, v in out2.items() if k != "bad"} == {2: 4, 3: 6, 5: 10, 6: 12}
    assert isinstance(out2["bad"], ValueError)


def test_a_send_that_raises_fails_its_round_and_the_next_caller_leads():
    calls = []

    def send(items):
        calls.append(items)
        if len(calls) == 1:
            raise ConnectionError("down")
        return items

    comb = Combiner(send)
    with pytest.raises(ConnectionError):
        comb.call("a")
    assert comb.call("b") == "b" and comb._leaders == 0


def test_a_round_takes_at_most_batch_jobs_max_items_and_round_bytes_max_bytes():
    """At the limits: BATCH_JOBS_MAX + 1 items waiting go as BATCH_JOBS_MAX, then one; items
    of exactly MERGE_BYTES_MAX bytes together go in one round, one byte more cuts it; an
    item larger than a round goes alone."""
    from shardq import limits

    take, slot = combine._take, combine._Slot
    many = [slot(i, 0) for i in range(limits.BATCH_JOBS_MAX)]
    assert len(take(slot("lead", 0), many)) == limits.BATCH_JOBS_MAX
    half = MERGE_BYTES_MAX // 2
    assert len(take(slot(0, half), [slot(1, half)])) == 2
    assert len(take(slot(0, half), [slot(1, half + 1)])) == 1
    assert len(take(slot(0, MERGE_BYTES_MAX + 1), [slot(1, 1)])) == 1


def test_a_round_is_cut_at_its_byte_limit():
    gate = Gate(3)
    comb = gate.comb = Combiner(gate, leaders=1)
    big = MERGE_BYTES_MAX // 2 + 1
    first, _ = run_callers(comb, [0])
    wait_until(lambda: comb._leaders, 5, what="the first round under way")
    threads = []
    for i in (1, 2, 3):  # queued in this order, each more than half a round's bytes
        t = threading.Thread(target=comb.call, args=(i, big))
        t.start()
        wait_until(lambda i=i: len(comb._waiting) >= i, 5, what="queued")
        threads.append(t)
    for t in [*first, *threads]:
        t.join(10)
    assert gate.rounds == [[0], [1], [2], [3]]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_caller_interrupted_while_waiting_leaves_unsent_and_strands_nobody():
    """KeyboardInterrupt in a caller waiting for the next round: its item leaves the queue
    (nothing sent), and the callers behind it still get a leader."""
    released, rounds = threading.Event(), []

    def send(items):
        rounds.append(list(items))
        if len(rounds) == 1:
            released.wait(10)  # the first round stays out until the interrupt was taken
        return [i * 2 for i in items]

    comb = Combiner(send, leaders=1)
    first, out = run_callers(comb, [1])
    wait_until(lambda: rounds, 5, what="the first round under way")

    def interrupt():
        wait_until(lambda: len(comb._waiting) >= 1, 5, what="the main thread waiting")
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own SIGINT handler, whatever this process inherited (a shell's background job
    # starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt).start()
        with pytest.raises(KeyboardInterrupt):
            comb.call(7)
    finally:
        signal.signal(signal.SIGINT, before)
    behind, out2 = run_callers(comb, [8])
    wait_until(lambda: len(comb._waiting) >= 1, 5, what="a caller behind")
    released.set()
    for t in [*first, *behind]:
        t.join(10)
    assert out == {1: 2} and out2 == {8: 16} and rounds == [[1], [8]] and comb._leaders == 0


@pytest.mark.parametrize("leaders", [1, 2])
def test_a_crowd_gets_every_outcome_right_with_one_or_more_rounds_out(leaders):
    """32 threads x 200 calls; ``send`` yields the GIL as a request's I/O would. Each caller
    gets its own item's outcome, rounds carry several items, and none is left leading."""
    out_at_once, most = [0], [0]
    guard = threading.Lock()

    def send(items):
        with guard:
            out_at_once[0] += 1
            most[0] = max(most[0], out_at_once[0])
        threading.Event().wait(0.0002)  # the request's I/O: other callers queue meanwhile
        with guard:
            out_at_once[0] -= 1
        return [(t, i * 3) for t, i in items]

    comb = Combiner(send, leaders=leaders)
    wrong: list = []

    def caller(t):
        for i in range(200):
            if comb.call((t, i)) != (t, i * 3):
                wrong.append((t, i))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong and comb._leaders == 0 and not comb._waiting
    assert comb.rounds < 32 * 200 and most[0] <= leaders


def test_with_two_leaders_a_second_round_goes_while_the_first_is_out():
    """Two rounds out at once: a caller that comes while one round waits for its reply
    leads its own, and returns before the first."""
    held, rounds = threading.Event(), []

    def send(items):
        rounds.append(list(items))
        if items == [1]:
            held.wait(10)  # the first round's reply is slow
        return [i * 2 for i in items]

    comb = Combiner(send, leaders=2)
    first, out = run_callers(comb, [1])
    wait_until(lambda: rounds, 5, what="the first round out")
    assert comb.call(2) == 4  # its own round, while the first is out
    held.set()
    for t in first:
        t.join(10)
    assert out == {1: 2} and rounds == [[1], [2]] and comb._leaders == 0


def test_a_caller_no_round_takes_within_its_timeout_leaves_unsent():
    """The round out holds its reply past a waiting caller's timeout: that caller leaves
    with ShardUnavailable and its item is in no round; the callers behind it still go."""
    held, rounds = threading.Event(), []

    def send(items):
        rounds.append(list(items))
        if len(rounds) == 1:
            held.wait(10)
        return [i * 2 for i in items]

    comb = Combiner(send, leaders=1)
    first, out = run_callers(comb, [1])
    wait_until(lambda: rounds, 5, what="the first round out")
    with pytest.raises(ShardUnavailable, match="not sent"):
        comb.call(7, 0, timeout=0.05)
    behind, out2 = run_callers(comb, [8])
    wait_until(lambda: comb._waiting, 5, what="a caller behind")
    held.set()
    for t in [*first, *behind]:
        t.join(10)
    assert out == {1: 2} and out2 == {8: 16} and rounds == [[1], [8]] and comb._leaders == 0
