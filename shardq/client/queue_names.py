"""Whether a queue exists, for the operations that would otherwise create one by naming it.

A pause, resume or limits change of a name the service does not know used to make it a
queue (a phantom, kept in stats, the console and backups for good). ``shardq queue
pause|resume|limit`` and the console's actions ask :func:`check_exists` first: a queue
exists when the service's config declares it (the shards' ``queue_config`` reply says
``declared``) or a shard holds it (it has, or had, jobs or a state such as paused).
"""
from __future__ import annotations

from typing import Any

from ..errors import ShardUnavailable, UnknownQueue

#: queue names an UnknownQueue message lists (a service may hold 100,000 a shard)
LISTED_MAX = 20


def check_exists(q: Any, name: str, *, create_hint: str = "") -> None:
    """UnknownQueue naming the queues that exist, unless the service's config declares
    ``name`` or a shard holds it. ``create_hint`` ends the message (how the caller makes a
    new queue on purpose). Asks the cheap question (is it declared) first: a stats reply
    lists every queue of every shard."""
    try:
        if q.queue_config(name).get("declared"):
            return
    except UnknownQueue:
        pass  # declare_queues = true, and not declared: refused below unless a shard holds it
    except ShardUnavailable:
        pass  # the shard asked is down: the others' stats may still know the queue
    st = q.stats()
    held = st.get("queues", {})
    if name in held:
        return
    names = sorted(held)
    listed = ", ".join(names[:LISTED_MAX]) + (f" and {len(names) - LISTED_MAX} more"
                                              if len(names) > LISTED_MAX else "") or "none"
    down = [sh["shard"] for sh in st.get("shards", []) if not sh.get("available", True)]
    raise UnknownQueue(f"no queue {name!r:.140}: the service holds no such queue and its config does not declare "
                       f"it (queues that exist: {listed}"
                       + (f"; shards {down} are down, so their queues are not listed" if down else "")
                       + ")" + (f"; {create_hint}" if create_hint else ""))
