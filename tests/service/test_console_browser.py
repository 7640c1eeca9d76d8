"""The web console in a real browser: headless Chromium (Debian's package) driven by
Selenium, against a real ``shardq serve``. Each action is clicked in the page and its
effect checked through the Python API. Skipped, with the reason, only where no browser is
installed (``.ci/setup-system`` installs one)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support import browser
from support.raw_shard import Raw
from support.service import REPO, Service, reset_queues, wait_until

WHY = browser.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no browser for the console tests: {WHY}")

CONFIG = {"queues": {"default": {}, "mail": {"max_deliveries": 1}}, "service": {"restart_backoff_max": 60}}
TOKEN = "browser-test-token-0123456789"


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config=CONFIG) as s:
        s.http_url()  # listening
        # The console wants the token serve made, on loopback too: open it as a person would,
        # by the URL `shardq console` prints (it logs in, then goes to the console). Every
        # open_console() goes through it, since another test's login replaces the cookie.
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("SHARDQ_HTTP_TOKEN", None)
        r = subprocess.run([sys.executable, "-m", "shardq.cli", "console", "--data-dir", s.data_dir],
                           capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and "/login?token=" in r.stdout, r.stderr
        s.url = r.stdout.strip()
        yield s


@pytest.fixture(scope="module")
def driver():
    with browser.chromium() as d:
        yield d


@pytest.fixture
def q(svc):
    with svc.connect() as router:
        yield router
        reset_queues(router, ("default", "mail"))


def open_console(driver, url):
    driver.get(url)
    wait_until(lambda: driver.execute_script("return document.body.dataset.ready") == "1", 20, 0.05,
               "the console's first overview")


def text(driver, css: str) -> str:
    """The element's text, read in one script call: the page re-renders every second, so an
    element handle found first and read after may already be gone (StaleElementReference)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';",
                                 css)


def texts(driver, css: str) -> list[str]:
    """Every matching element's text, in one script call (see text())."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.textContent.trim());", css)


def cells(driver, queue) -> dict:
    """The queue's row as {column class: text}, read from the page."""
    return driver.execute_script("""
        const tr = document.querySelector(`#queues tr[data-queue="${arguments[0]}"]`);
        if (!tr) return null;
        const out = {};
        for (const td of tr.querySelectorAll("td[class]")) out[td.className] = td.textContent;
        return out;""", queue)


def click(driver, css):
    driver.find_element("css selector", css).click()


def test_the_console_shows_the_queue_counts_the_api_reports(driver, svc, q):
    for i in range(7):
        q.enqueue(f"job {i}".encode(), key=f"user-{i % 3}")
    q.enqueue(b"later", delay=600)
    open_console(driver, svc.url)
    want = q.stats()["queues"]["default"]
    row = wait_until(lambda: (lambda r: r and r["ready"] == str(want["ready"]) and r)(cells(driver, "default")),
                     10, 0.1, "the default queue's row")
    for k in ("ready", "delayed", "waiting", "in_flight", "dead", "keys"):
        assert row[k] == str(want[k]), k
    assert row["state"] == "active" and row["oldest"].endswith("s")
    shards = texts(driver, "#shards tbody tr")
    assert len(shards) == 2 and all("up" in r for r in shards)
    assert texts(driver, "#shards tbody tr td.pid") == [str(p) for p in q.ping()]


def test_pause_and_resume_buttons(driver, svc, q):
    q.enqueue(b"held back")
    open_console(driver, svc.url)
    wait_until(lambda: cells(driver, "default"), 10, 0.1, "the default queue's row")
    click(driver, 'button.pause[data-queue="default"]')
    wait_until(lambda: q.stats()["queues"]["default"].get("paused"), 10, 0.05, "the queue paused")
    assert q.dequeue(wait=0.2) is None
    wait_until(lambda: cells(driver, "default")["state"] == "paused", 10, 0.1, "the page showing it paused")
    click(driver, 'button.resume[data-queue="default"]')
    wait_until(lambda: "paused" not in q.stats()["queues"]["default"], 10, 0.05, "the queue resumed")
    lease = q.dequeue(wait=1)
    assert lease is not None and lease.body == b"held back"
    q.ack(lease)


def _dead_letters(q, n):
    ids = [q.enqueue(f'{{"to": "user{i}@example.com"}}'.encode(), queue="mail", key=f"m{i}") for i in range(n)]
    leases = []
    while len(leases) < n:
        leases += q.dequeue_many("mail", max_jobs=n, wait=1)
    for lease in leases:
        q.nack(lease, error="SMTPError: 550 mailbox unavailable")
    return ids


def _show_dead_letters(driver, svc, queue, n):
    open_console(driver, svc.url)
    wait_until(lambda: cells(driver, queue), 10, 0.1, f"the {queue} row")
    driver.execute_script("const s = document.querySelector('#dl-queue'); s.value = arguments[0];"
                          "s.dispatchEvent(new Event('change'));", queue)
    wait_until(lambda: len(driver.find_elements("css selector", "#dead-letters tbody tr")) == n
               and driver.find_element("css selector", "#dead-letters").get_attribute("data-state") == "loaded",
               10, 0.05, "the dead letters listed")


def test_redrive_and_purge_selected_dead_letters(driver, svc, q):
    ids = _dead_letters(q, 3)
    _show_dead_letters(driver, svc, "mail", 3)
    errors = texts(driver, "#dead-letters td.error")
    assert errors == ["SMTPError: 550 mailbox unavailable"] * 3
    click(driver, f'input.dl-select[value="{ids[0]}"]')
    click(driver, "#dl-redrive")
    wait_until(lambda: ids[0] not in {d.job_id for d in q.dead_letters("mail")}, 10, 0.05, "the redrive")
    again = q.dequeue("mail", wait=1)
    assert again.job_id == ids[0] and again.attempt == 1  # a fresh delivery count
    q.ack(again)
    wait_until(lambda: len(driver.find_elements("css selector", "#dead-letters tbody tr")) == 2, 10, 0.05,
               "the list reloaded")
    click(driver, f'tr[data-id="{ids[1]}"] button.purge')
    driver.switch_to.alert.accept()
    wait_until(lambda: [d.job_id for d in q.dead_letters("mail")] == [ids[2]], 10, 0.05, "the purge")


def test_a_dead_task_shows_its_name_and_arguments(driver, svc, q):
    """Issue 44, item 7: the body cell of a task's dead letter read as raw msgpack."""
    from shardq.tasks import body as taskbody
    jid = q.enqueue(taskbody.encode("myapp.tasks.send_welcome", (42,), {"template": "short"}), queue="mail")
    q.nack(q.dequeue("mail", wait=1), error="SMTPError: 550")
    _show_dead_letters(driver, svc, "mail", 1)
    assert texts(driver, f'tr[data-id="{jid}"] td.body') == [
        'task myapp.tasks.send_welcome {"args": [42], "kwargs": {"template": "short"}}']


# Holds the reply to every dead-letter request for the "default" queue until the test calls
# the releases in window.__held, and sets window.__staleDrawn once the page has had that reply
# (a task after its JSON is read: the console's handler runs in the microtasks before it).
HOLD_DEFAULT_DEAD_LETTERS = """
window.__held = [];
const realFetch = window.fetch.bind(window);
window.fetch = async (url, opts) => {
  const r = await realFetch(url, opts);
  if (!String(url).includes("/api/dead-letters?queue=default")) return r;
  const json = r.json.bind(r);
  r.json = async () => { const d = await json(); setTimeout(() => { window.__staleDrawn = true; }, 0); return d; };
  await new Promise((release) => window.__held.push(release));
  return r;
};
"""


def test_a_late_reply_for_the_first_queue_does_not_replace_the_chosen_queues_list(driver, svc, q):
    """The page loads the first queue's dead letters on its own; a user who picks another
    queue before that reply arrives must keep seeing the queue they picked (the CI failure
    of 2026-12-01: the late reply drew an empty list over mail's three)."""
    # A dead letter in default too: the page opens on the first queue that holds some.
    q.enqueue(b"makes default the first queue with dead letters")
    q.bury(q.dequeue(wait=1), error="buried by the test")  # the fixture purges it afterwards
    ids = _dead_letters(q, 3)
    hook = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                  {"source": HOLD_DEFAULT_DEAD_LETTERS})["identifier"]
    try:
        _show_dead_letters(driver, svc, "mail", 3)
        wait_until(lambda: driver.execute_script("return window.__held.length") >= 1, 10, 0.05,
                   "the first queue's request held")
        driver.execute_script("window.__held.forEach((release) => release());")
        wait_until(lambda: driver.execute_script("return window.__staleDrawn === true"), 10, 0.05,
                   "the late reply handled")
        assert driver.execute_script("return document.querySelector('#dl-queue').value") == "mail"
        assert sorted(texts(driver, "#dead-letters td.id")) == sorted(str(i) for i in ids)
        assert driver.find_element("css selector", "#dead-letters").get_attribute("data-state") == "loaded"
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook})


def test_look_up_and_cancel_a_job(driver, svc, q):
    first = q.enqueue(b"first", key="acct")
    second = q.enqueue(b"second", key="acct")
    open_console(driver, svc.url)
    box = driver.find_element("css selector", "#job-id")
    box.send_keys(str(second))
    click(driver, "#job-lookup")
    wait_until(lambda: driver.find_element("css selector", "#job-result").get_attribute("data-state") == "waiting",
               10, 0.05, "the job shown")
    position = text(driver, '#job-result tr[data-field="position"] td')
    assert position == "1"
    click(driver, "#job-cancel")
    driver.switch_to.alert.accept()
    wait_until(lambda: driver.find_element("css selector", "#job-result").get_attribute("data-state") == "missing",
               10, 0.05, "the job gone")
    assert q.cancel(second) == "gone"
    lease = q.dequeue(wait=1)
    assert lease.job_id == first
    q.ack(lease)
    assert q.dequeue(wait=0.2) is None


def test_the_console_logs_in_with_the_token(driver, monkeypatch):
    monkeypatch.setenv("SHARDQ_HTTP_TOKEN", TOKEN)
    with Service(shards=1) as s, s.connect() as q:
        q.enqueue(b"x")
        url = s.http_url()
        driver.get(url)
        wait_until(lambda: driver.current_url.endswith("/login"), 10, 0.05, "the login page")
        driver.find_element("css selector", "#token").send_keys(TOKEN)
        click(driver, "#login")
        wait_until(lambda: driver.execute_script("return document.body.dataset.ready") == "1", 20, 0.05,
                   "the console after login")
        wait_until(lambda: (cells(driver, "default") or {}).get("ready") == "1", 10, 0.1, "the counts")
        click(driver, 'button.pause[data-queue="default"]')
        wait_until(lambda: q.stats()["queues"]["default"].get("paused"), 10, 0.05, "the pause, logged in")
        driver.delete_all_cookies()


def test_a_partly_paused_queue_offers_pause_to_finish_it_and_resume(driver, svc, q):
    """The tester's partly_paused.py: a queue whose pause missed a shard was offered resume
    only, so the pause could not be finished from the console (docs/operations.md, "Pause")."""
    q.pause("default")
    q.resume("default")  # held by both shards

    def on_shard(shard: int, op: str) -> None:  # what a pause or resume that missed the other leaves
        raw = Raw(svc, shard)
        try:
            raw.call(op, "default")
        finally:
            raw.close()

    def shown() -> tuple:
        return (cells(driver, "default") or {}).get("state"), tuple(texts(driver, 'tr[data-queue="default"] button'))

    def paused_on() -> list:
        return [bool(sh["queues"].get("default", {}).get("paused")) for sh in q.stats()["shards"]]

    on_shard(0, "pause")
    open_console(driver, svc.url)
    wait_until(lambda: shown() == ("partly paused", ("pause", "resume")), 10, 0.05, "partly paused, both buttons")
    click(driver, 'button.pause[data-queue="default"]')  # finish the pause
    wait_until(lambda: paused_on() == [True, True], 10, 0.05, "paused on both shards")
    wait_until(lambda: shown() == ("paused", ("resume",)), 10, 0.05, "the page showing it paused")
    on_shard(1, "resume")
    wait_until(lambda: shown() == ("partly paused", ("pause", "resume")), 10, 0.05, "partly paused again")
    click(driver, 'button.resume[data-queue="default"]')
    wait_until(lambda: paused_on() == [False, False], 10, 0.05, "resumed on both shards")
    wait_until(lambda: shown() == ("active", ("pause",)), 10, 0.05, "the page showing it active")


# Replaces GET /api/overview with a made-up service of three shards, whose counters grow by
# 6 a second each (18/s in all; not rounded, so a rate is 18 but for timing) from lifetime
# figures (shard 2 has run a long time), each shard 100 jobs deep; the test stops shard 2
# (window.__fake.down) and restarts shard 1 (restartedAt: a new pid, counters from 0). The
# page's own 2 s poll is turned off: the test polls, one poll at a time. ``queues`` is what
# the overview lists.
FAKE_OVERVIEW = """
window.setInterval = () => 0;
window.__fake = { down: false, restartedAt: null, queues: [] };
const fakeStart = Date.now() / 1000;
const realFetch = window.fetch.bind(window);
window.fetch = async (url, opts) => {
  if (!String(url).startsWith("/api/overview")) return realFetch(url, opts);
  const now = Date.now() / 1000, f = window.__fake;
  const shards = [0, 1, 2].map((i) => {
    if (i === 2 && f.down) return { shard: 2, up: false, error: "no answer", pid: null, totals: null };
    const restarted = i === 1 && f.restartedAt !== null;
    const n = restarted ? 6 * (now - f.restartedAt) : [1000, 5000, 1000000][i] + 6 * (now - fakeStart);
    return { shard: i, up: true, error: null, pid: restarted ? 2001 : 1000 + i,
             totals: { ready: 100, delayed: 0, waiting: 0, in_flight: 0, dead: 0, keys: 0, enqueued: n, acked: n } };
  });
  const totals = { ready: 0, delayed: 0, waiting: 0, in_flight: 0, dead: 0, keys: 0, enqueued: 0, acked: 0 };
  for (const s of shards) if (s.totals) for (const k of Object.keys(totals)) totals[k] += s.totals[k];
  return new Response(JSON.stringify({ queues: f.queues, shards, totals }),
                      { status: 200, headers: { "Content-Type": "application/json" } });
};
"""


def _with_fake_overview(driver, svc):
    """Open the console on FAKE_OVERVIEW; returns the hook to remove."""
    hook = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FAKE_OVERVIEW})["identifier"]
    open_console(driver, svc.url)
    return hook


def _poll(driver) -> None:
    driver.execute_async_script("poll().then(arguments[arguments.length - 1]);")


def test_the_charts_count_each_shards_own_figures_across_a_stop_and_a_restart(driver, svc):
    """The tester's rate_spike2.py: with a shard stopped for 6 s, then continued, the rate
    charts drew its lifetime counter as one poll's (3554/s against a real 18/s) and the
    depth a dip; a restarted shard's counters starting again made the rates drop to 0."""
    hook = _with_fake_overview(driver, svc)
    try:
        for step in range(16):
            if step == 4:
                driver.execute_script("window.__fake.down = true;")  # shard 2 stops answering
            if step == 8:
                driver.execute_script("window.__fake.down = false;")  # and is back
            if step == 11:
                driver.execute_script("window.__fake.restartedAt = Date.now() / 1000 - 0.05;")  # shard 1 restarts
            time.sleep(0.25)  # a pace: the fake counters grow with the clock between polls; not synchronisation
            _poll(driver)
            if step == 6:
                assert text(driver, "#depth") == "300" and text(driver, "#depth-note") == "(shard 2: last known)"
        h = driver.execute_script("return history")
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook})
    assert h["depth"] == [300] * len(h["depth"]), h["depth"]  # a shard missing: its last depth, no dip
    assert text(driver, "#depth-note") == ""
    for k in ("enqueued", "acked"):
        # 18/s with every shard answering, 12/s while one is not counted: never a spike (the
        # lifetime counter of shard 2 over one poll: millions a second), never 0
        assert len(h[k]) >= 15 and all(4 < r < 40 for r in h[k]), (k, h[k])


def test_a_limited_queue_whose_owner_is_down_says_so(driver, svc):
    """Its owner shard down, a limited queue's cell says so (the overview has no figures for
    it: never another shard's), and there is nothing to edit."""
    row = {"name": "capped", "ready": 0, "delayed": 0, "waiting": 0, "in_flight": 0, "dead": 0, "keys": 0,
           "oldest_ready_age_s": None, "paused": False, "partly_paused": False, "paused_shards": 0,
           "limits": {"owner": 2, "owner_down": True}}
    hook = _with_fake_overview(driver, svc)
    try:
        driver.execute_script("window.__fake.queues = arguments[0];", [row])
        _poll(driver)
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook})
    assert cells(driver, "capped")["limits"] == "owner shard 2 down: figures not known"
    assert texts(driver, 'tr[data-queue="capped"] button') == ["pause"]


def test_the_console_keeps_working_with_a_shard_down(driver, svc):
    """Last in this module: it leaves the shared service with a shard down. It makes the
    queue it looks at itself (on both shards): under -n 2 the tests before it may have run
    in the other process, with its own service."""
    with svc.connect() as q:
        for _ in range(2):
            q.enqueue(b"one on each shard")  # (keyless: the router takes the shards in turn)
    open_console(driver, svc.url)
    wait_until(lambda: cells(driver, "default"), 10, 0.1, "the default queue's row")
    shard_dir = os.path.join(svc.data_dir, "shard-1")
    os.rename(shard_dir, shard_dir + ".away")
    open(shard_dir, "w").close()  # a file where its directory should be: every restart fails
    with svc.connect() as q:
        os.kill(q.ping()[1], signal.SIGKILL)
    wait_until(lambda: "down" in text(driver, '#shards tr[data-shard="1"]'),
               20, 0.1, "shard 1 shown down")
    wait_until(lambda: "1 shard down" in text(driver, "#updated"), 10, 0.1,
               "the header saying so")
    assert cells(driver, "default") is not None
