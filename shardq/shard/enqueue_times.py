"""When was job N enqueued? A sampled table, so no job carries a timestamp.

A job costs 96 bytes (``Job.__slots__``); a float per job would add a slot and a float
object, about 32 bytes, a third more, for one metric (the age of the oldest ready job).
Job ids grow with enqueue order within a shard, so a few (sequence, time) samples answer the
question for every job: job ``s`` was enqueued at or after the time of the last sample
whose sequence is ``<= s``.

* :meth:`EnqueueTimes.note` is called with every ENQUEUE operation (live and in replay, so
  the table is the same either way) and keeps one sample per ``RESOLUTION_S``.
* Past ``SAMPLES_MAX`` samples, every other sample of the older half is dropped: recent
  jobs keep a resolution of ``RESOLUTION_S``, older ones a coarser one, memory stays bounded.
* An estimate is never later than the true enqueue time (an age is never under-reported)
  and is early by less than the gap between two samples. A wall clock that steps back is
  ignored until it passes the last sample again.
"""
from __future__ import annotations

import bisect

RESOLUTION_S = 1.0
SAMPLES_MAX = 4096


class EnqueueTimes:
    __slots__ = ("seqs", "times")

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.times: list[float] = []

    def note(self, seq: int, at: float) -> None:
        """Job ``seq`` was enqueued at ``at`` (cheap: one comparison in the common case)."""
        times = self.times
        if times and (at - times[-1] < RESOLUTION_S or seq <= self.seqs[-1]):
            return
        self.seqs.append(seq)
        times.append(at)
        if len(times) > SAMPLES_MAX:
            self._thin()

    def _thin(self) -> None:
        half = len(self.seqs) // 2
        self.seqs[:half] = self.seqs[:half:2]
        self.times[:half] = self.times[:half:2]

    def at(self, seq: int) -> float | None:
        """The latest time at or before which job ``seq`` was enqueued; None if unknown
        (a job older than every sample, e.g. from a log written before this table existed)."""
        i = bisect.bisect_right(self.seqs, seq) - 1
        return self.times[i] if i >= 0 else None

    def load(self, seqs: list[int], times: list[float]) -> None:
        self.seqs = list(seqs)
        self.times = list(times)
