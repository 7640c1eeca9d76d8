"""A workflow in the console (issue 34: "the console shows a workflow's steps, states,
progress and result size"): an embedded service (``App.embedded``, whose watcher records
how each workflow ends) with the HTTP listener of ``shardq serve`` on it, workflows sent
and run by ``app.run_worker``, then ``GET /api/workflow?id=``:

* a chord: its members ready, then its callback pending with the arrivals its barrier
  counted, then every step succeeded, the callback with its result's size; once the
  watcher saw it end, the record says ``succeeded`` with when it ended and expires;
* a chain whose middle step raises ``shardq.Fail``: that step ``dead`` with its error, the
  step after it pending, and the record ``failed`` with an error that names the step;
* an id with no record is a 404; an id no record can have (empty, over
  ``limits.BARRIER_ID_BYTES_MAX`` bytes, missing) a 400, one at that limit a 404;
* more steps than ``DESCRIBE_STEPS_MAX``: the first ones listed, every one counted.

Every reply is checked against the OpenAPI document. Last, in headless Chromium where one
is installed: the workflow panel shows the record and the steps (state, progress, note,
error, result size), an error and a note holding HTML as text, the cut, and a step's job
id that fills the job look-up."""
from __future__ import annotations

from urllib.parse import quote

import jsonschema
import msgpack
import pytest

import shardq
from shardq import chain, chord, group, limits
from shardq.service.console import openapi
from shardq.tasks import workflow

from support import browser
from support.http_calls import api
from support.service import wait_until
from support.task_apps import drain, embedded_with_http, fresh_tasks

TOKEN = "workflow-view-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
DOC = openapi.document()
ENDED_WITHIN_S = 30  # the watcher looks every ~1 s once a shard's pong (~2.5 s) says it holds running records


@pytest.fixture(scope="module")
def app():
    with embedded_with_http(TOKEN, {"queue_defaults": {"max_deliveries": 1},
                                              "queues": {"default": {}, "later": {}}}) as a:
        yield a


@pytest.fixture
def fresh(app):
    """The shared app with no tasks; its queues emptied after the test."""
    with fresh_tasks(app) as a:
        yield a


def look_up(app, wf_id: str | None, status: int = 200) -> dict:
    """``GET /api/workflow``, its status checked and its reply validated against the document."""
    path = "/api/workflow" if wf_id is None else f"/api/workflow?id={quote(wf_id, safe='')}"
    got, reply = api(app.url, path, headers=BEARER)
    assert got == status, reply
    schema = "Workflow" if status == 200 else "Error"
    jsonschema.validate(reply, {"$ref": f"#/components/schemas/{schema}", "components": DOC["components"]})
    return reply


def ended(app, wf_id: str) -> dict:
    """The workflow's description once the watcher recorded its end."""
    wait_until(lambda: look_up(app, wf_id)["state"] != "running", ENDED_WITHIN_S, 0.1,
               f"the watcher recording how {wf_id} ended")
    return look_up(app, wf_id)


def job_ids(wf) -> list[str | None]:
    """Each step's job id as the API writes it."""
    return [None if row["job_id"] is None else str(row["job_id"]) for row in wf.status()]


def send_chord(app, members: int, later: int = 0):
    """A chord of ``members`` ``score`` jobs, the last ``later`` of them on queue ``later``
    (so that draining ``default`` leaves them ready), whose callback sums their results."""
    @app.task
    def score(ctx, d: int) -> int:
        return d * 10

    @app.task(queue="later")
    def score_later(ctx, d: int) -> int:
        return d * 10

    @app.task
    def summarize(ctx, results: list) -> dict:
        return {"total": sum(results)}

    calls = [(score_later if d >= members - later else score).s(d) for d in range(members)]
    return chord(group(calls), summarize.s()).send()


def send_failing_chain(app, message: str, note: str = "looked up 1 of 2"):
    """add, then ``broken`` (reports ``note`` at half way, then raises ``shardq.Fail``), then
    a step that never runs."""
    @app.task
    def add(ctx, x: int, y: int) -> int:
        return x + y

    @app.task
    def broken(ctx, x: int) -> int:
        ctx.progress(0.5, note)
        raise shardq.Fail(message)

    @app.task
    def total(ctx, x: int) -> int:
        return x

    return chain(add.s(1, 2), broken.s(), total.s()).send()


# ---------------------------------------------------------------------------- the API
def test_a_chord_shows_each_steps_state_the_arrivals_and_the_callbacks_result_size(fresh):
    wf = send_chord(fresh, members=5, later=1)
    info = look_up(fresh, wf.id)
    assert info["id"] == wf.id and info["state"] == "running" and info["error"] is None
    assert info["ended_at"] is None and info["expires_at"] is None and info["started_at"] > 0
    assert info["steps_total"] == info["steps_shown"] == 6
    assert [s["step"] for s in info["steps"]] == [f"0.0.{j}" for j in range(5)] + ["0.1"]
    assert [s["job_id"] for s in info["steps"]] == job_ids(wf)
    assert info["steps_by_state"] == {"ready": 5, "pending": 1}
    member, callback = info["steps"][0], info["steps"][5]
    assert member["task"].endswith("score") and member["attempts"] == 0 and member["result_bytes"] is None
    assert callback["task"].endswith("summarize") and callback["job_id"] is None

    drain(fresh)  # four members: the fifth waits on queue "later"
    info = look_up(fresh, wf.id)
    assert info["steps_by_state"] == {"succeeded": 4, "ready": 1, "pending": 1}
    assert info["steps"][5]["state"] == "pending"
    assert (info["steps"][5]["arrived"], info["steps"][5]["total"]) == (4, 5)  # its barrier counted four

    drain(fresh, "later")
    drain(fresh)  # the callback, enqueued by the last arrival
    assert wf.result(timeout=10) == {"total": 100}
    info = look_up(fresh, wf.id)
    assert info["steps_by_state"] == {"succeeded": 6}
    assert [s["job_id"] for s in info["steps"]] == job_ids(wf) and None not in job_ids(wf)
    for s in info["steps"][:5]:  # their values went to the barrier, not kept
        assert s["state"] == "succeeded" and s["result_bytes"] is None and s["error"] is None
    callback = info["steps"][5]
    assert callback["state"] == "succeeded" and callback["result_bytes"] == len(msgpack.packb({"total": 100}))
    assert "arrived" not in callback

    done = ended(fresh, wf.id)
    assert done["state"] == "succeeded" and done["error"] is None
    assert done["started_at"] <= done["ended_at"]
    assert done["expires_at"] == pytest.approx(done["ended_at"] + workflow.RECORD_KEPT_S)
    assert done["steps_by_state"] == {"succeeded": 6}


def test_a_failed_chain_shows_the_dead_step_and_the_record_names_it(fresh):
    message = "no such account <b>x</b>"
    wf = send_failing_chain(fresh, message)
    drain(fresh)
    info = look_up(fresh, wf.id)
    first, failed, last = info["steps"]
    assert [first["step"], failed["step"], last["step"]] == ["0.0", "0.1", "0.2"]
    assert first["state"] == "succeeded" and first["task"].endswith("add")
    assert failed["state"] == "dead" and failed["task"].endswith("broken") and failed["attempts"] == 1
    assert message in failed["error"] and failed["job_id"] == job_ids(wf)[1]
    assert failed["progress"] == 0.5 and failed["note"] == "looked up 1 of 2"  # what it reported before it failed
    assert last["state"] == "pending" and last["job_id"] is None and last["result_bytes"] is None
    assert info["steps_by_state"] == {"succeeded": 1, "dead": 1, "pending": 1}

    done = ended(fresh, wf.id)
    assert done["state"] == "failed" and done["ended_at"] is not None
    assert "step 0.1" in done["error"] and failed["task"] in done["error"] and message in done["error"]


def test_an_id_without_a_record_is_not_found_and_one_no_record_can_have_is_refused(app):
    reply = look_up(app, "0" * 20, 404)
    assert reply["error"] == "NotFound" and "not found" in reply["message"]
    at_most = limits.BARRIER_ID_BYTES_MAX
    for wf_id in ("x" * at_most, "\u00e9" * (at_most // 2) + "x" * (at_most % 2)):  # at the limit: looked for
        assert len(wf_id.encode()) == at_most
        assert look_up(app, wf_id, 404)["error"] == "NotFound"
    for wf_id in ("", "x" * (at_most + 1), "\u00e9" * (at_most // 2 + 1), None):  # None: no id in the query
        reply = look_up(app, wf_id, 400)
        assert reply["error"] == "InvalidJob" and "workflow id" in reply["message"], wf_id


def test_a_workflow_of_more_steps_than_are_listed_shows_the_first_and_counts_them_all(fresh, monkeypatch):
    wf = send_chord(fresh, members=5)
    for steps_max, shown in ((3, 3), (5, 5), (6, 6), (7, 6)):
        monkeypatch.setattr(workflow, "DESCRIBE_STEPS_MAX", steps_max)
        info = look_up(fresh, wf.id)
        assert info["steps_total"] == 6 and info["steps_shown"] == len(info["steps"]) == shown
        assert [s["step"] for s in info["steps"]] == ([f"0.0.{j}" for j in range(5)] + ["0.1"])[:shown]
        assert info["steps_by_state"] == {"ready": 5, "pending": 1}  # every step, shown or not


# ---------------------------------------------------------------------------- the page
WHY = browser.missing()


@pytest.mark.skipif(WHY is not None, reason=f"no browser for the console tests: {WHY}")
def test_the_workflow_panel_shows_the_record_and_the_steps_as_text(fresh, monkeypatch):
    message = "<b>x</b> <img src=x onerror=\"document.body.dataset.owned=1\">"
    note = "<i>half</i> & more"
    wf = send_failing_chain(fresh, message, note)
    summed = send_chord(fresh, members=2)
    drain(fresh)
    drain(fresh)  # the chord's callback, if the first drain went idle before it was enqueued
    assert summed.result(timeout=10) == {"total": 10}
    ended(fresh, wf.id)
    ended(fresh, summed.id)
    monkeypatch.setattr(workflow, "DESCRIBE_STEPS_MAX", 2)
    failed_job = job_ids(wf)[1]

    def text(selector: str):
        return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
                                selector)

    def show(wf_id: str, state: str) -> None:
        box = d.find_element("css selector", "#wf-id")
        box.clear()
        box.send_keys(wf_id)
        d.find_element("css selector", "#wf-lookup").click()
        wait_until(lambda: d.find_element("css selector", "#wf-result").get_attribute("data-state") == state,
                   10, 0.05, f"workflow {wf_id} shown {state}")

    with browser.chromium() as d:
        d.get(f"{fresh.url}login?token={TOKEN}")
        wait_until(lambda: d.execute_script("return document.body.dataset.ready") == "1", 20, 0.05, "the console")
        show(wf.id, "failed")
        assert text('#wf-result tr[data-field="id"] td') == wf.id
        assert text('#wf-result tr[data-field="state"] td') == "failed"
        error = text('#wf-result tr[data-field="error"] td')
        assert "step 0.1" in error and message in error  # the HTML as text
        assert text('#wf-result tr[data-field="ended_at"] td') != "–"
        assert text('#wf-result tr[data-field="steps_by_state"] td') == "3 steps: 1 dead · 1 pending · 1 succeeded"
        rows = d.execute_script("return Array.from(document.querySelectorAll('#wf-steps tbody tr'),"
                                " (tr) => Array.from(tr.cells, (td) => td.textContent));")
        assert [r[:5] for r in rows] == [["0.0", wf.steps[0].task, job_ids(wf)[0], "succeeded", "–"],
                                         ["0.1", wf.steps[1].task, failed_job, "dead", "1"]]
        assert message in text('#wf-steps tr[data-step="0.1"] td.error')
        assert rows[1][5:7] == ["50 %", note] and rows[0][5:] == ["–", "", "", "–"]
        assert text("#wf-note").startswith("2 of 3 steps shown")
        assert d.execute_script("return document.querySelectorAll('#wf-result b, #wf-result img,"
                                " #wf-steps b, #wf-steps i, #wf-steps img').length") == 0
        assert d.execute_script("return document.body.dataset.owned") is None

        d.find_element("css selector", '#wf-steps tr[data-step="0.1"] button.job-link').click()
        wait_until(lambda: text('#job-result tr[data-field="job_id"] td') == failed_job
                   and d.find_element("css selector", "#job-result").get_attribute("data-state") == "dead",
                   10, 0.05, "the failed step's job in the job panel")

        monkeypatch.setattr(workflow, "DESCRIBE_STEPS_MAX", 3)
        show(wf.id, "failed")
        assert text("#wf-note") == "" and len(d.find_elements("css selector", "#wf-steps tbody tr")) == 3
        show(summed.id, "succeeded")
        assert text('#wf-result tr[data-field="steps_by_state"] td') == "3 steps: 3 succeeded"
        assert text('#wf-steps tr[data-step="0.1"] td.result') == f"{len(msgpack.packb({'total': 10}))} B"
        assert text('#wf-steps tr[data-step="0.0.0"] td.result') == "–"  # its value went to the barrier
        show("0" * 20, "missing")
        assert text('#wf-result tr[data-field="error"] td').startswith("NotFound: ")
        assert not d.find_element("css selector", "#wf-steps").is_displayed()
