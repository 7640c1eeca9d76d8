"""Make the console screenshots in docs/ (``python tests/support/console_screenshots.py``).

Starts a real service with three queues and some traffic (producers, a consumer that acks
most jobs and fails a few into the dead-letter queue), lets the live charts fill for
``--seconds``, then saves docs/console.png (the overview) and docs/console-dead-letters.png
(the dead-letter browser and a job look-up)."""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import browser  # noqa: E402 - after the sys.path line above
from support.service import REPO, Service, wait_until  # noqa: E402 - after the sys.path line above

# Screenshots of the console itself, not of its login page: no token (loopback only).
CONFIG = {"queues": {"default": {}, "emails": {"max_deliveries": 2}, "reports": {}},
          "http": {"listen": "127.0.0.1:0", "auth": "none"}}


def traffic(q, stop: threading.Event) -> None:
    rng = random.Random(7)
    failures = 0
    while not stop.is_set():
        q.enqueue_many([{"body": f"order {rng.randrange(10**6)}".encode(), "key": f"customer-{rng.randrange(40)}"}
                        for _ in range(rng.randrange(5, 30))])
        q.enqueue(b'{"to": "someone@example.com", "template": "welcome"}', queue="emails",
                  key=f"user-{rng.randrange(1000)}")
        for lease in q.dequeue_many("default", max_jobs=rng.randrange(5, 25)):
            q.ack(lease)
        for lease in q.dequeue_many("emails", max_jobs=2):
            if failures < 12 and rng.random() < 0.5:  # a few dead letters (two deliveries each)
                failures += 1
                q.nack(lease, error="SMTPRecipientsRefused: 550 5.1.1 mailbox unavailable")
            else:
                q.ack(lease)
        stop.wait(0.2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--out", default=os.path.join(REPO, "docs"))
    a = ap.parse_args()
    why = browser.missing()
    if why:
        print(f"no browser: {why}", file=sys.stderr)
        return 1
    with Service(shards=2, config=CONFIG) as svc, svc.connect() as q, browser.chromium(1280, 1180) as d:
        for i in range(300):
            q.enqueue(f"monthly report {i}".encode(), queue="reports", key=f"tenant-{i % 12}")
        q.pause("reports")
        stop = threading.Event()
        th = threading.Thread(target=traffic, args=(q, stop), daemon=True)
        th.start()
        d.get(svc.http_url())
        wait_until(lambda: d.execute_script("return document.body.dataset.ready") == "1", 20, 0.1, "console")
        time.sleep(a.seconds)  # let the charts fill with real traffic
        d.save_screenshot(os.path.join(a.out, "console.png"))
        stop.set()
        th.join()
        d.execute_script("const s = document.querySelector('#dl-queue'); s.value = 'emails';"
                         "s.dispatchEvent(new Event('change'));")
        wait_until(lambda: d.find_elements("css selector", "#dead-letters tbody tr"), 20, 0.1, "dead letters")
        first = d.find_elements("css selector", "#dead-letters input.dl-select")
        for box in first[:2]:
            box.click()
        d.find_element("css selector", "#dead-letters tbody tr button.lookup").click()
        wait_until(lambda: d.find_element("css selector", "#job-result").get_attribute("data-state") == "dead",
                   20, 0.1, "job look-up")
        d.execute_script("window.scrollTo(0, document.querySelector('#shards').getBoundingClientRect().bottom"
                         " + window.scrollY)")
        d.save_screenshot(os.path.join(a.out, "console-dead-letters.png"))
    print(f"wrote {a.out}/console.png and console-dead-letters.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
