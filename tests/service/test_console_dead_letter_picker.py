"""The console's dead-letter picker opens on the first queue that holds dead letters, not
on the first queue by name (often an empty one). In a real browser, against a real
``shardq serve``; skipped, with the reason, only where no browser is installed, like the
other console tests (``.ci/setup-system`` installs one)."""
from __future__ import annotations

import pytest

from support import browser
from support.service import Service, wait_until

WHY = browser.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no browser for the console tests: {WHY}")


def test_the_picker_opens_on_the_first_queue_with_dead_letters():
    # This test is about the picker, not access: no token (loopback only; docs/operations.md)
    config = {"queues": {"alpha": {}, "zulu": {"max_deliveries": 1}}, "http": {"listen": "127.0.0.1:0", "auth": "none"}}
    with Service(shards=1, config=config) as svc, svc.connect() as q:
        q.enqueue(b"alive", queue="alpha")  # first by name, and no dead letters
        dead = q.enqueue(b"poison", queue="zulu")
        q.nack(q.dequeue("zulu", wait=5), error="boom")
        url = svc.http_url()
        with browser.chromium() as driver:
            driver.get(url)
            picked = wait_until(lambda: driver.execute_script(
                "const t = document.querySelector('#dead-letters');"
                "return t.dataset.state === 'loaded' && document.querySelector('#dl-queue').value;"),
                20, 0.05, "the dead letters loaded")
            ids = driver.execute_script(
                "return Array.from(document.querySelectorAll('#dead-letters tbody tr'), r => r.dataset.id);")
    assert picked == "zulu"
    assert ids == [str(dead)]
