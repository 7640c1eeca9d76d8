"""One lease per key at the API: the per-group head buffer of the SQS backend. Pure: no I/O,
time passed in.

An SQS FIFO receive may return several messages of one message group (= key) in one batch;
MassTransit#4355 and spring-cloud-aws#756 ran them in parallel by mistake. Here only the
first message of a group is handed out. The rest are *followers*: still received (hidden)
on SQS, held here in order, and handed out one at a time, each only after its predecessor
was acked. The buffer decides; its owner does the requests it asks for:

* ``admit`` takes a receive's messages and returns the ones to hand out now (new heads);
* ``acked`` after a head's delete succeeded: its first follower becomes available, and
  ``take_available`` hands it out;
* ``drop`` when a head is nacked, lost or fails to ack: its followers must be released,
  in order, before the head can come back (SQS then redelivers the group in order);
* ``due(now)`` says which followers to extend (their head is still live) and which to
  release: those whose head's lease is about to end (released *before* the head becomes
  visible, so the group comes back head first even on a server that mis-orders the
  redelivery of a timed-out batch), and available followers nobody took for ``hold_s``.

A follower whose own deadline has passed is never handed out or released: SQS has
already made it visible, and its receipt handle is stale.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .sqs_mapping import Incoming


@dataclass
class Held:
    """A received message held by this client (a follower, or a head handed out)."""

    queue: str
    msg: Incoming
    deadline: float        # local and conservative: never later than SQS's own
    received_at: float     # local time just before the receive (SQS's 12 h limit counts from it)
    margin: float = 0.0    # the buffer acts this long before ``deadline`` (a share of the lease)


@dataclass
class _Group:
    head: Held | None                     # handed out, not yet acked; None: available
    followers: deque[Held] = field(default_factory=deque)
    available_since: float | None = None


class HeadBuffer:
    def __init__(self, hold_s: float):
        self.hold_s = hold_s       # an available follower nobody takes is released after this
        self._groups: dict[tuple[str, str], _Group] = {}

    def __len__(self) -> int:
        """Followers held (not handed out)."""
        return sum(len(g.followers) for g in self._groups.values())

    def admit(self, held: list[Held], now: float) -> list[Held]:
        """Messages of one receive, in order. Returns those to hand out now."""
        out = []
        for h in held:
            k = (h.queue, h.msg.group)
            g = self._groups.get(k)
            if g is not None and g.head is not None and g.head.deadline <= now:
                # The old head's lease ended: SQS has redelivered the group, and these are
                # its messages again with new receipt handles. Forget the stale state.
                g = None
                del self._groups[k]
            if g is None:
                self._groups[k] = _Group(head=h)
                out.append(h)
            else:
                g.followers.append(h)
        return out

    def take_available(self, queue: str, now: float, limit: int) -> list[Held]:
        """Followers whose predecessor was acked, to hand out now (at most ``limit``)."""
        out: list[Held] = []
        for k, g in list(self._groups.items()):
            if len(out) >= limit:
                break
            if k[0] != queue or g.head is not None:
                continue
            while g.followers and g.followers[0].deadline <= now:
                g.followers.popleft()  # visible again on SQS already: not ours
            if not g.followers:
                del self._groups[k]
                continue
            g.head, g.available_since = g.followers.popleft(), None
            out.append(g.head)
        return out

    def is_head(self, queue: str, group: str, receipt: str) -> bool:
        g = self._groups.get((queue, group))
        return g is not None and g.head is not None and g.head.msg.receipt == receipt

    def head_extended(self, queue: str, group: str, receipt: str, deadline: float) -> None:
        g = self._groups.get((queue, group))
        if g is not None and g.head is not None and g.head.msg.receipt == receipt:
            g.head.deadline = deadline

    def acked(self, queue: str, group: str, receipt: str, now: float) -> None:
        k = (queue, group)
        g = self._groups.get(k)
        if g is None or g.head is None or g.head.msg.receipt != receipt:
            return
        if g.followers:
            g.head, g.available_since = None, now
        else:
            del self._groups[k]

    def drop(self, queue: str, group: str, receipt: str, now: float) -> list[Held]:
        """The head ended without an ack: followers to release, in order."""
        k = (queue, group)
        g = self._groups.get(k)
        if g is None or g.head is None or g.head.msg.receipt != receipt:
            return []
        del self._groups[k]
        return [f for f in g.followers if f.deadline > now]

    def release_all(self, now: float) -> list[Held]:
        out = [f for g in self._groups.values() for f in g.followers if f.deadline > now]
        self._groups.clear()
        return out

    def due(self, now: float) -> tuple[list[Held], list[Held]]:
        """(followers to extend, followers to release in order) at ``now``."""
        extend: list[Held] = []
        release: list[Held] = []
        for k, g in list(self._groups.items()):
            live = [f for f in g.followers if f.deadline > now]
            if g.head is not None:
                done = g.head.deadline - g.head.margin <= now   # the head's lease is ending
            else:
                done = not live or now - (g.available_since or now) >= self.hold_s  # unclaimed
            if done:
                del self._groups[k]
                release.extend(live)
                continue
            g.followers = deque(live)
            extend.extend(f for f in live if f.deadline - f.margin <= now)
        return extend, release

    def extended(self, held: Held, deadline: float) -> None:
        held.deadline = deadline

    def next_due(self) -> float | None:
        """When :meth:`due` next has something to do (None: no follower held). A head
        without followers needs nothing: its entry only guards against a second lease."""
        times = []
        for g in self._groups.values():
            if not g.followers:
                continue
            if g.head is not None:
                times.append(g.head.deadline - g.head.margin)
            elif g.available_since is not None:
                times.append(g.available_since + self.hold_s)
            times.extend(f.deadline - f.margin for f in g.followers)
        return min(times) if times else None

    def forget_expired(self, now: float) -> None:
        """Drop entries of heads without followers whose lease has ended (bookkeeping)."""
        for k, g in list(self._groups.items()):
            if not g.followers and (g.head is None or g.head.deadline <= now):
                del self._groups[k]
