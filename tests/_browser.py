"""Headless Chromium from Debian's packages for the page tests (the explorer, the docs site): one driver setup.
Nothing is downloaded: Selenium Manager is kept offline and the binaries are the system's (QKV_CHROMIUM and
QKV_CHROMEDRIVER override their paths)."""

from __future__ import annotations

import os
from collections.abc import Iterator

CHROMIUM = os.environ.get("QKV_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("QKV_CHROMEDRIVER", "/usr/bin/chromedriver")


def headless_chrome(width: int, height: int = 1000) -> Iterator:
    """A Selenium Chrome driver on the system's Chromium, window ``width x height``; quits after the yield."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager download anything
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
