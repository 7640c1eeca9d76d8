"""Sends of more calls than one request takes (``limits.BATCH_JOBS_MAX``): ``send_many`` and a
group's ``.send()`` check every call before the first job is sent, so a call the queue would
refuse (a body over the queue's ``max_body_bytes``, a key over 512 bytes) after the 10,000th
sends nothing (before, each 10,000 were checked and sent alone: the first were in). Against
an embedded service of 2 shards."""
from __future__ import annotations

import pytest

import shardq
from shardq import group, limits

from support.task_apps import fresh_tasks, jobs_held

SMALL_BODY = 300  # queue "small"'s max_body_bytes
N = limits.BATCH_JOBS_MAX + 1


@pytest.fixture(scope="module")
def app():
    a = shardq.App.embedded(shards=2, config={"queues": {"small": {"max_body_bytes": SMALL_BODY}}})
    yield a
    a.close()


@pytest.fixture
def fresh(app):
    with fresh_tasks(app) as a:
        yield a


def declare(app):
    @app.task(queue="small", name="b.small")
    def small(ctx, note: str) -> str:
        return note

    @app.task(queue="small", name="b.keyed", key=lambda k, **_: k)
    def keyed(ctx, k: str) -> str:
        return k
    return small, keyed


@pytest.mark.parametrize("last, refusal", [("body", "over the queue's limit"), ("key", "key")])
def test_send_many_past_the_batch_limit_checks_every_call_before_sending_any(fresh, last, refusal):
    small, keyed = declare(fresh)
    if last == "body":
        task, calls = small, [(("a",), {})] * (N - 1) + [(("a" * SMALL_BODY,), {})]
    else:
        task, calls = keyed, [((f"k{i}",), {}) for i in range(N - 1)] + [(("k" * (limits.KEY_BYTES_MAX + 1),), {})]
    with pytest.raises(shardq.InvalidJob, match=refusal):
        task.send_many(calls)
    assert jobs_held(fresh) == 0  # nothing was sent
    ids = task.send_many(calls[:-1] + calls[:1])  # the same without the bad call: all in, ids in order
    assert len(set(ids)) == N and jobs_held(fresh) == N


@pytest.mark.parametrize("last, refusal", [("body", "over the queue's limit"), ("key", "key")])
def test_a_group_past_the_batch_limit_refused_at_send_sends_nothing(fresh, last, refusal):
    small, keyed = declare(fresh)
    if last == "body":
        members = [small.s("a") for _ in range(N - 1)] + [small.s("a" * SMALL_BODY)]
    else:
        members = [keyed.s(f"k{i}") for i in range(N - 1)] + [keyed.s("k" * (limits.KEY_BYTES_MAX + 1))]
    with pytest.raises(shardq.InvalidJob, match=refusal):
        group(*members).send()
    assert jobs_held(fresh) == 0  # "A workflow refused at .send() sends nothing" (docs/workflows.md)
    wf = group(*members[:-1], members[0]).send()
    assert len(wf.first_ids) == N and jobs_held(fresh) == N
