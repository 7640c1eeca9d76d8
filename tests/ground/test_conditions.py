"""CountedCondition counts its waiters under the lock, so a signaller that reads 0 while
holding the lock can skip notify_all without a waiter missing it."""
import threading
import time

from shardq.conditions import CountedCondition


def test_waiters_counts_threads_in_wait_and_drops_back_on_return():
    lock = threading.Lock()
    cond = CountedCondition(lock)
    released = []

    def waiter():
        with lock:
            while not released:
                cond.wait()

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a polled deadline, not a sleep
        with lock:
            if cond.waiters == 3:
                break
    with lock:
        assert cond.waiters == 3
        released.append(True)
        cond.notify_all()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    with lock:
        assert cond.waiters == 0


def test_a_timed_out_wait_is_no_longer_counted():
    lock = threading.Lock()
    cond = CountedCondition(lock)
    with lock:
        assert cond.wait(0.01) is False
        assert cond.waiters == 0
