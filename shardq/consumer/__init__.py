"""The consumer side: the worker runner, running one job, idempotency stores."""
