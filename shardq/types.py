"""Values handed to users: leases and dead letters."""
from __future__ import annotations

from typing import NamedTuple, Union

#: A job id: an ``int`` on the local shards, a ``str`` on backends with string ids (SQS).
JobId = Union[int, str]  # noqa: UP007 - a runtime alias object: kept typing.Union so its repr and docs stay
#: A lease token (fences one delivery): an ``int`` locally, a ``str`` (receipt handle) on SQS.
Token = Union[int, str]  # noqa: UP007 - a runtime alias object: kept typing.Union so its repr and docs stay


class Lease(NamedTuple):
    """One delivery of a job. Valid until ``deadline`` (wall-clock seconds) unless extended.

    ``token`` fences this delivery: ack/nack/extend with it fail with ``LeaseLost`` once the
    job has been leased again; nack/extend also once ``deadline`` has passed, while an ack
    past it still deletes the job if nobody leased it since (as SQS's DeleteMessage).
    ``attempt`` is the 1-based delivery count, durable across shard restarts.
    """

    job_id: JobId
    key: str | None
    body: bytes
    queue: str
    attempt: int
    token: Token
    deadline: float


class DeadLetter(NamedTuple):
    """A job moved to its queue's dead-letter queue after ``attempts`` deliveries."""

    job_id: JobId
    key: str | None
    body: bytes
    queue: str
    attempts: int
    error: str | None


class DeadLetterPage(NamedTuple):
    """One page of dead letters (``Router.dead_letters_page``): ``cursor`` fetches the next
    page (None: this was the last); ``skipped_shards`` were down and left out."""

    items: list[DeadLetter]
    cursor: str | None
    skipped_shards: list[int]
