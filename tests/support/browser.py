"""Headless Chromium (Debian's package) driven by Selenium, for the console tests and the
screenshots in docs/. Nothing is downloaded: the browser and chromedriver are the system
ones (``.ci/setup-system`` installs them), and Selenium Manager is kept offline.

:func:`chromium` is a context manager yielding a WebDriver; on exit it quits the browser
and then ends, by PID, any of its processes still alive (also when the test failed)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import psutil

from .service import poll_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000")


def missing() -> str | None:
    """Why no browser test can run here, or None."""
    try:
        import selenium  # noqa: F401 - imported only to see whether selenium is installed
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (run .ci/setup-system, or apt-get install chromium chromium-driver)"
    return None


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 1000):
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.remote.webdriver import WebDriver as RemoteWebDriver

    profile = tempfile.mkdtemp(prefix="sq-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.add_argument(f"--window-size={width},{height}")
    service = DriverService(executable_path=CHROMEDRIVER)
    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=opts)
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        procs = []
        if service.process is not None:
            try:
                parent = psutil.Process(service.process.pid)
                procs = [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        if driver is not None:
            try:
                # Ending the session closes the browser. Not driver.quit(): its service.stop()
                # asks chromedriver to shut down and, finding it still listening just after
                # the request, sleeps a whole second (selenium 4); the driver process is
                # ended by PID below instead.
                RemoteWebDriver.quit(driver)
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        # Dead is enough: a killed browser process whose parent (chromedriver) is gone is
        # a zombie until PID 1 reaps it, which psutil.wait_procs would wait for (1-2 s
        # under this VM's PID 1, per browser).
        poll_until(lambda: not any(_running(p) for p in procs), time.monotonic() + 10)
        if service.process is not None:
            service.process.wait(10)  # the Popen learns its exit too
        shutil.rmtree(profile, ignore_errors=True)


def _running(p: psutil.Process) -> bool:
    """``p`` (the process seen at the start, not a later one with its PID) still runs."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
