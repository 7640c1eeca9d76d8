"""Workflows and results in the console's job look-up (issue 34; docs/workflows.md): an
embedded service (``App.embedded``) with the HTTP listener of ``shardq serve`` on it, a
chord sent and run by ``app.run_worker``, then ``GET /api/job``:

* a member not run yet shows its task, the barrier it reports to (member index of total)
  and how long its result is kept; the chord's callback, enqueued by the barrier, the
  barrier it reads its inputs from;
* a step acked with its result kept is ``"state": "succeeded"`` with the result's size and
  expiry (as ``shardq job show``), not a 404; one acked without a result is still a 404;
* a job that failed once shows the progress its task reported and its error;
* a body that is not a task body, or one whose workflow fields hold other types, or
  arguments nested past what ``describe`` decodes, is still answered as the document says.

Every reply is checked against the OpenAPI document. Last, in headless Chromium where one
is installed: the job panel shows those fields as text (a note holding HTML stays text)."""
from __future__ import annotations

import time

import jsonschema
import msgpack
import pytest

import shardq
from shardq import chord, group, limits
from shardq.service.console import openapi

from support import browser
from support.task_apps import drain, embedded_with_http, fresh_tasks
from support.http_calls import api
from support.service import wait_until

TOKEN = "workflow-console-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
DOC = openapi.document()


@pytest.fixture(scope="module")
def app():
    with embedded_with_http(TOKEN, {"queue_defaults": {"max_deliveries": 3},
                                    "queues": {"default": {}, "sums": {}, "flaky": {}, "plain": {}}}) as a:
        yield a


@pytest.fixture
def fresh(app):
    """The shared app with no tasks; its queues emptied after the test."""
    with fresh_tasks(app) as a:
        yield a


def look_up(app, job_id, status: int = 200) -> dict:
    """``GET /api/job``, its status checked and its reply validated against the document."""
    got, reply = api(app.url, f"/api/job?id={job_id}", headers=BEARER)
    assert got == status, reply
    schema = "Job" if status == 200 else "Error"
    jsonschema.validate(reply, {"$ref": f"#/components/schemas/{schema}", "components": DOC["components"]})
    return reply


def send_chord(app, members: int = 3):
    """A chord of ``members`` ``score`` jobs (queue default) whose callback ``summarize``
    runs on queue ``sums``: running ``default`` alone leaves the callback enqueued, live."""
    @app.task(key=lambda d: f"doc-{d}", keep_result=limits.WORKFLOW_RESULT_S_DEFAULT)
    def score(ctx, d: int) -> int:
        return d * 10

    @app.task(queue="sums")
    def summarize(ctx, results: list, label: str) -> dict:
        return {"label": label, "total": sum(results)}

    return chord(group(score.s(d) for d in range(members)), summarize.s("total")).send()


# ---------------------------------------------------------------------------- the API
def test_a_member_shows_its_task_and_the_barrier_it_reports_to(fresh):
    wf = send_chord(fresh, members=3)
    rows = wf.status()
    [(shard, barrier)] = wf.barriers
    for index, row in enumerate(rows[:3]):
        info = look_up(fresh, row["job_id"])
        assert info["state"] == "ready" and info["job_id"] == str(row["job_id"]) and info["queue"] == "default"
        task = info["task"]
        assert task["name"] == row["task"] and task["args"].startswith('{"args": [')
        assert task["reports_to"] == {"barrier": barrier, "shard": shard, "index": index, "total": 3}
        assert task["inputs_from"] is None
        assert task["keep_result"] == limits.WORKFLOW_RESULT_S_DEFAULT  # as its task says
        assert info["progress"] is None and info["note"] is None
        assert info["result_bytes"] is None and info["result_expires_at"] is None


def test_the_callback_shows_its_inputs_and_a_step_acked_with_its_result_kept_is_succeeded(fresh):
    wf = send_chord(fresh, members=3)
    [(shard, barrier)] = wf.barriers
    drain(fresh, "default")
    rows = wf.status()
    assert [r["state"] for r in rows[:3]] == ["succeeded"] * 3
    callback = rows[3]["job_id"]
    assert callback is not None  # enqueued by the barrier when the last member arrived
    info = look_up(fresh, callback)
    assert info["state"] == "ready" and info["queue"] == "sums"
    assert info["task"]["inputs_from"] == {"barrier": barrier, "shard": shard}
    assert info["task"]["reports_to"] is None  # the last step: nothing after it

    before = time.time()
    for d, row in enumerate(rows[:3]):
        info = look_up(fresh, row["job_id"])  # acked: not live, its result kept
        assert info == {"job_id": str(row["job_id"]), "shard": row["job_id"] & ((1 << limits.JOB_ID_SHARD_BITS) - 1),
                        "state": "succeeded", "progress": None, "note": None,
                        "result_bytes": len(msgpack.packb(d * 10)), "result_expires_at": info["result_expires_at"]}
        assert before < info["result_expires_at"] <= before + limits.WORKFLOW_RESULT_S_DEFAULT + 60
    drain(fresh, "sums")
    assert wf.result(timeout=10) == {"label": "total", "total": 30}
    done = look_up(fresh, callback)
    assert done["state"] == "succeeded"
    assert done["result_bytes"] == len(msgpack.packb({"label": "total", "total": 30}))


def test_a_job_acked_without_a_kept_result_is_still_not_found(fresh):
    @fresh.task(queue="plain")
    def plain(ctx):
        return 1

    job_id = plain.send()
    info = look_up(fresh, job_id)
    assert info["task"]["keep_result"] is None and info["task"]["reports_to"] is None
    drain(fresh, "plain")
    reply = look_up(fresh, job_id, 404)
    assert reply["error"] == "NotFound" and "no result kept" in reply["message"]


def test_a_kept_result_at_its_maximum_shows_beside_the_live_state_of_a_job_not_yet_acked(fresh):
    @fresh.task(queue="plain", keep_result=600)
    def kept(ctx):
        return None

    job_id = kept.send()
    q = fresh.queue
    lease = q.dequeue("plain", wait=1)
    assert lease.job_id == job_id
    value = msgpack.packb(b"r" * (limits.RESULT_BYTES_MAX - 5))  # bin 32: a 5-byte header
    assert len(value) == limits.RESULT_BYTES_MAX
    q.put_result(lease, value, 600)  # what the worker does before its ack
    info = look_up(fresh, job_id)
    assert info["state"] == "leased" and info["result_bytes"] == limits.RESULT_BYTES_MAX
    assert info["task"]["keep_result"] == 600
    q.ack(lease)
    info = look_up(fresh, job_id)
    assert info["state"] == "succeeded" and info["result_bytes"] == limits.RESULT_BYTES_MAX


def test_a_job_that_failed_shows_the_progress_its_task_reported(fresh):
    note = "half way <b>through</b> & \u00e9\u2603"

    @fresh.task(queue="flaky", keep_result=60)
    def flaky(ctx):
        ctx.progress(0.5, note)
        # a fixed delay, not the task's jittered backoff (which may be ~0 and let the
        # drain run it again): the job waits, delayed, after one attempt
        raise shardq.Retry(600, "not this time")

    job_id = flaky.send()
    drain(fresh, "flaky")
    info = look_up(fresh, job_id)
    assert info["state"] == "delayed" and info["attempts"] == 1
    assert info["progress"] == 0.5 and info["note"] == note
    assert "not this time" in info["error"] and info["result_bytes"] is None


def test_the_note_at_its_maximum_is_shown_whole(fresh):
    q = fresh.queue
    job_id = q.enqueue(b"plain bytes", queue="plain")
    lease = q.dequeue("plain", wait=1)
    note = "\u00e9" * (limits.PROGRESS_NOTE_BYTES_MAX // 2)  # 512 bytes of UTF-8
    q.progress(lease, 1.0, note)
    info = look_up(fresh, job_id)
    assert info["progress"] == 1.0 and info["note"] == note and info["task"] is None
    assert info["body"] == "plain bytes"
    q.ack(lease)


def test_bodies_from_elsewhere_are_answered_as_the_document_says(fresh):
    """The workflow fields of a body are only shaped on the way in (a list of six, of
    three): a barrier that is not text is shown as text, a count that is not an integer
    is null, an infinite keep_result is null; arguments nested deeper than ``describe``
    decodes leave the body undecoded (``task`` null) rather than fail the look-up."""
    q = fresh.queue
    odd = msgpack.packb({"t": "x" * 1000, "a": [float("nan")], "k": {}, "v": 2, "r": float("inf"),
                         "w": [b"\xff", True, 0, "1", 5, None], "in": [{"k": 1}, 2**63, "all"]})
    info = look_up(fresh, q.enqueue(odd, queue="plain"))
    task = info["task"]
    assert task["name"] == "x" * 200 + "…" and task["keep_result"] is None
    assert task["reports_to"] == {"barrier": "{'base64': '/w=='}", "shard": None, "index": 0, "total": None}
    assert task["inputs_from"] == {"barrier": "{'k': 1}", "shard": 2**63}
    deep: list = []
    for _ in range(500):
        deep = [deep]
    nested = q.enqueue(msgpack.packb({"t": "deep", "a": deep, "k": {}, "v": 1}), queue="plain")
    info = look_up(fresh, nested)
    assert info["task"] is None and info["body_bytes"] > 500


# ---------------------------------------------------------------------------- the page
WHY = browser.missing()


@pytest.mark.skipif(WHY is not None, reason=f"no browser for the console tests: {WHY}")
def test_the_job_panel_shows_the_workflow_fields_as_text(fresh):
    note = "<img src=x onerror=\"document.body.dataset.owned=1\"> 3 of 4"

    @fresh.task(queue="flaky")
    def flaky(ctx):
        ctx.progress(0.75, note)
        raise RuntimeError("again")

    failed = flaky.send()
    wf = send_chord(fresh, members=2)
    [(shard, barrier)] = wf.barriers
    member = wf.status()[0]["job_id"]

    def field(name: str):
        return d.execute_script(
            "const e = document.querySelector(`#job-result tr[data-field=\"${arguments[0]}\"] td`);"
            "return e ? e.textContent : null;", name)

    def show(job_id, *states: str) -> None:
        box = d.find_element("css selector", "#job-id")
        box.clear()
        box.send_keys(str(job_id))
        d.find_element("css selector", "#job-lookup").click()
        wait_until(lambda: field("job_id") == str(job_id)
                   and d.find_element("css selector", "#job-result").get_attribute("data-state") in states,
                   10, 0.05, f"job {job_id} shown {' or '.join(states)}")

    with browser.chromium() as d:
        d.get(f"{fresh.url}login?token={TOKEN}")
        wait_until(lambda: d.execute_script("return document.body.dataset.ready") == "1", 20, 0.05, "the console")
        show(member, "ready")
        assert field("reports_to") == f"barrier {barrier} on shard {shard}: member 0 of 2"
        assert field("inputs_from") == "–" and field("keep_result") == "1.0 d" and field("result") == "none kept"
        assert field("progress") == "–"
        drain(fresh, "default")
        drain(fresh, "flaky")
        show(member, "succeeded")
        assert field("result").startswith("1 B, kept until ") and field("progress") == "–"
        assert field("queue") is None and field("task") is None  # not live: only what is kept
        assert not d.find_element("css selector", "#job-cancel").is_enabled()
        callback = wf.status()[2]["job_id"]
        show(callback, "ready")
        assert field("task") == wf.status()[2]["task"] and field("queue") == "sums"
        assert field("inputs_from") == f"barrier {barrier} on shard {shard}"
        assert field("reports_to") == "–"
        assert d.find_element("css selector", "#job-cancel").is_enabled()
        show(failed, "delayed", "ready")
        assert field("progress") == f"75 % · {note}" and "again" in field("error")
        assert d.execute_script("return document.querySelectorAll('#job-result img').length") == 0
        assert d.execute_script("return document.body.dataset.owned") is None
