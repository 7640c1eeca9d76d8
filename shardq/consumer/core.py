"""The worker core: what every runner (threads, processes, asyncio) keeps and decides."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class WorkerStats:
    leased: int = 0       # leases received
    succeeded: int = 0    # handler ran (and committed), acked
    duplicates: int = 0   # already processed: handler skipped, acked
    failed: int = 0       # handler raised: nacked with backoff
    lost: int = 0         # lease lost: not acked, the redelivery wins
    expired: int = 0      # deadline passed before it started: not run
    released: int = 0     # not started, handed back (stop, or waited too long for a runner)
    abandoned: int = 0    # still running when the grace period ended: lease released
    unavailable: int = 0  # ShardUnavailable answers seen

    @property
    def processed(self) -> int:
        return self.succeeded + self.duplicates + self.failed + self.lost + self.expired
