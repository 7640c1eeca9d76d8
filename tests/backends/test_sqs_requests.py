"""API requests per job on the SQS backend, counted (docs/scale-out.md quotes these counts):
one job per call costs 3 requests; the batched worker path at most 0.35."""
from __future__ import annotations

from bench.probes.sqs_requests import CONFIG, TARGET_BATCHED, measure
from support.sqs_server import fresh_target


def test_single_calls_cost_three_requests_per_job(moto):
    r = measure(fresh_target(moto, CONFIG), "single", 30)
    assert r["requests_per_job"] == 3.0
    assert r["by_operation"] == {"SendMessage": 30, "ReceiveMessage": 30, "DeleteMessage": 30}


def test_batched_worker_path_is_within_the_target(moto):
    r = measure(fresh_target(moto, CONFIG), "batched", 100)
    assert r["requests_per_job"] <= TARGET_BATCHED
    assert r["by_operation"]["SendMessageBatch"] == 10


def test_the_worker_runner_batches_too(moto):
    r = measure(fresh_target(moto, CONFIG), "worker", 80)
    assert r["requests_per_job"] < 1.0  # well under one job per call; docs give the measured figure
    assert set(r["by_operation"]) <= {"SendMessageBatch", "ReceiveMessage", "DeleteMessageBatch",
                                      "ChangeMessageVisibility", "ChangeMessageVisibilityBatch"}
