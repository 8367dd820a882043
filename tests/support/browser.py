"""A real browser for the page's tests: Debian's chromium, headless, driven by Selenium through Debian's
chromium-driver (both installed by scripts/install-clients.sh; a missing one fails, never skips).

Chromium runs with a fresh profile, no sandbox (the tests may run as root) and none of its own network traffic
(these machines refuse outside connections): only the agent under test is reached. Screenshots go to
ARTIFACTS (`.artifacts/browser/` in the repository, or $VBMC_TEST_ARTIFACTS), kept after the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("VBMC_TEST_ARTIFACTS", REPO / ".artifacts")) / "browser"
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = "chromedriver"


def browser_paths() -> tuple[str, str]:
    browser = next((found for name in CHROMIUM if (found := shutil.which(name))), None)
    driver = shutil.which(DRIVER)
    if browser is None or driver is None:
        pytest.fail("the page's tests need Debian's chromium and chromium-driver (scripts/install-clients.sh "
                    "installs them)")
    return browser, driver


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium under WebDriver, with its console log kept (driver.get_log("browser"))."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = browser_paths()
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for drivers online
    with tempfile.TemporaryDirectory(prefix="kubevbmc-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-default-apps", "--no-first-run", "--disable-extensions",
                     f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.set_capability("acceptInsecureCerts", True)  # the agent's certificate comes from a test CA
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
        driver.set_page_load_timeout(20)
        try:
            yield driver
        finally:
            driver.quit()


def screenshot(driver: Any, name: str, full_page: bool = False) -> Path:
    """The window (or, `full_page`, the whole page through the DevTools protocol) as ARTIFACTS/<name>.png."""
    import base64

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if full_page:
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
    else:
        driver.save_screenshot(str(path))
    return path


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors and CSP violations since the last call."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" or "Content Security Policy" in entry["message"]]
