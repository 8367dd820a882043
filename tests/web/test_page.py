"""The BMC's page in a real browser (headless Chromium, tests/support/browser.py) against agents on kubesim: log in,
watch power change when ipmitool powers the VM on, read the serial login prompt and type a line that echoes, see the
screen show the boot and change after a reset, insert an image and watch its task complete, power off from the
page, log out and see the consoles close; on a narrow screen too, and for a member of a pooled agent."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, free_port, write_serving_certificate
from ..support.browser import chromium, console_errors, screenshot
from ..support.cluster import Sim, wait_for
from ..support.rfb import screen_text
from ..support.vms import printable

SCREEN_PIXELS = """
const canvas = document.querySelector('#screen canvas');
if (!canvas || !canvas.width) return null;
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
let text = '';
for (let i = 0; i < data.length; i += 32768) text += String.fromCharCode.apply(null, data.subarray(i, i + 32768));
return [canvas.width, canvas.height, btoa(text)];
"""


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None, tmp_path: Path) -> Iterator[AgentProcess]:
    cert, key = write_serving_certificate(tmp_path)
    https = free_port()
    with agent_for_vm(sim, api, namespace, "--redfish-tls-address", f"127.0.0.1:{https}", "--tls-cert", str(cert),
                      "--tls-key", str(key)) as process:
        process.page = f"https://127.0.0.1:{https}/"  # type: ignore[attr-defined]
        yield process


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def until(driver: Any, check: Any, what: str, timeout: float = 20) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: check(d), message=what)


def text_of(driver: Any, selector: str) -> str:
    return str(driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''",
                                     selector))


def log_in(driver: Any, url: str) -> None:
    driver.get(url)
    until(driver, lambda d: d.find_element(By.ID, "username").is_displayed(), "the login form")
    driver.find_element(By.ID, "username").send_keys(USER)
    driver.find_element(By.ID, "password").send_keys(PASSWORD + Keys.ENTER)
    until(driver, lambda d: d.find_element(By.ID, "bmc").is_displayed(), "the BMC's sections after logging in")


def power_pill(driver: Any) -> str:
    return text_of(driver, "#power")


def terminal(driver: Any) -> str:
    """The serial terminal's text (its buffer: xterm.js draws only rows that are on screen)."""
    return str(driver.execute_script("return kubevbmc.serialText()"))


def screen(driver: Any) -> tuple[str, int]:
    """The screen canvas read as text, and how many of its pixels are lit."""
    found = driver.execute_script(SCREEN_PIXELS)
    if found is None:
        return "", 0
    width, height, data = found
    pixels = base64.b64decode(data).decode("latin-1").encode("latin-1")
    lit = sum(1 for i in range(0, len(pixels), 4) if pixels[i:i + 3] != b"\0\0\0")
    return screen_text(pixels, width, height), lit


def test_the_page_drives_the_vm_and_shows_its_consoles(agent: AgentProcess, browser: Any, api: client.ApiClient,
                                                       namespace: str, image_server: Any) -> None:
    page = agent.page  # type: ignore[attr-defined]
    log_in(browser, page)
    until(browser, lambda d: power_pill(d) == "Power: Off", "the VM shown off")

    # ipmitool powers the VM on: the page hears it through the EventService's SSE stream.
    assert agent.ipmitool("power", "on").returncode == 0
    until(browser, lambda d: power_pill(d) == "Power: On", "the VM shown on")
    until(browser, lambda d: "has powered on" in text_of(d, "#events"), "the power-on event in the log")

    # The serial console: the login prompt, and a line typed that the guest answers.
    until(browser, lambda d: "vm login:" in terminal(d), "the serial login prompt")
    browser.find_element(By.CSS_SELECTOR, "#terminal textarea").send_keys("operator" + Keys.ENTER)
    until(browser, lambda d: "vm login: operator" in terminal(d) and "Password:" in terminal(d),
          "the typed line echoed and answered")

    # The screen: the boot and tty1's own prompt; keys typed on it; a reset redraws it.
    until(browser, lambda d: screen(d)[0].endswith("vm login:"), "the login prompt on the screen")
    canvas = browser.find_element(By.CSS_SELECTOR, "#screen canvas")
    canvas.click()
    canvas.send_keys("hello")
    until(browser, lambda d: screen(d)[0].endswith("vm login: hello"), "the keys typed on the screen")
    screenshot(browser, "page-wide")
    browser.execute_script("window.scrollTo(0, 0)")
    screenshot(browser, "page-full", full_page=True)  # docs/images/web-page.png is one of these
    browser.find_element(By.CSS_SELECTOR, '[data-reset="ForceRestart"]').click()
    until(browser, lambda d: (lambda text, lit: lit > 0 and text.endswith("vm login:") and "hello" not in text)(
        *screen(d)), "the screen redrawn by the reset")
    assert "the machine is off" not in text_of(browser, "#screen-status")

    # Ctrl-Alt-Del reaches the guest (it reboots: the serial line says so), and the screen can be saved.
    browser.find_element(By.ID, "ctrl-alt-del").click()
    until(browser, lambda d: "reboot: Restarting system" in terminal(d), "the guest rebooting on Ctrl-Alt-Del")
    browser.find_element(By.ID, "screenshot").click()
    assert browser.find_element(By.ID, "screenshot-link").get_attribute("href").startswith("data:image/png;base64,")

    # Virtual media: insert an image and follow its task to the end.
    image = f"{image_server.base}/installer.iso"
    browser.find_element(By.ID, "media-Cd-image").send_keys(image)
    browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] .insert').click()
    until(browser, lambda d: text_of(d, '[data-slot="Cd"] .task-message').startswith("Completed"),
          "the insert's task completed", timeout=40)
    assert browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] progress').get_attribute("value") == "100"
    until(browser, lambda d: image in text_of(d, '[data-slot="Cd"] .media-state'), "the image shown inserted")

    # Power off from the page: the VM stops.
    browser.find_element(By.CSS_SELECTOR, '[data-reset="ForceOff"]').click()
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=20, what="the VM stopped")
    until(browser, lambda d: power_pill(d) == "Power: Off", "the VM shown off again")
    until(browser, lambda d: "not available" in text_of(d, "#serial-status"), "the serial console told of it")
    until(browser, lambda d: "not available" in text_of(d, "#screen-status"), "the screen told of it")

    # Power on again from the page: both consoles come back by themselves, on the new VMI.
    browser.find_element(By.CSS_SELECTOR, '[data-reset="On"]').click()
    until(browser, lambda d: text_of(d, "#screen-status") == "Connected to the screen.", "the screen back",
          timeout=40)
    until(browser, lambda d: screen(d)[0].endswith("vm login:"), "the new boot's prompt on the screen")
    until(browser, lambda d: text_of(d, "#serial-status") == "Connected to the serial console.", "the line back")

    # Logging out closes both consoles.
    browser.find_element(By.ID, "logout").click()
    until(browser, lambda d: d.find_element(By.ID, "login-section").is_displayed(), "the login form again")
    until(browser, lambda d: d.execute_script("return [kubevbmc.serial, kubevbmc.screen]") == ["closed", "closed"],
          "both consoles closed")
    wait_for(lambda: agent.output().count("console' vm=vm result='closed:") >= 2, what="the audit lines")
    errors = console_errors(browser)
    assert errors == [], "\n".join(errors)


def test_the_page_on_a_narrow_screen_and_its_accessibility(agent: AgentProcess, api: client.ApiClient,
                                                           namespace: str) -> None:
    with chromium(width=390, height=844) as driver:
        log_in(driver, agent.page)  # type: ignore[attr-defined]
        until(driver, lambda d: "Power: Off" in power_pill(d), "the power state")
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        screenshot(driver, "page-narrow")
        # Every form control has a label, every button a name; the live states are announced.
        unlabelled = driver.execute_script("""
            return [...document.querySelectorAll('input, select, textarea:not(.xterm-helper-textarea)')]
              .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
              .map(e => e.id || e.outerHTML.slice(0, 80));""")
        assert unlabelled == []
        nameless = driver.execute_script("""
            return [...document.querySelectorAll('button')].filter(b => !b.textContent.trim()).length;""")
        assert nameless == 0
        assert driver.find_element(By.ID, "power").get_attribute("aria-live") == "polite"
        # The keyboard alone reaches the power buttons.
        body = driver.find_element(By.TAG_NAME, "body")
        reached = set()
        for _ in range(12):
            body.send_keys(Keys.TAB)
            reached.add(driver.execute_script("return document.activeElement.dataset.reset || ''"))
        assert "On" in reached
        assert console_errors(driver) == []


def test_a_member_of_a_pooled_agent_serves_its_own_page(sim: Sim, api: client.ApiClient, namespace: str,
                                                        bmc_crd: None, tmp_path: Path, browser: Any) -> None:
    from ..agent.test_pool import PoolProcess, new_member, put_pool_secret
    from ..support.vms import make_bmc, make_vm

    members = [new_member(i) for i in range(2)]
    for member in members:
        make_vm(api, namespace, member.vm, run_strategy="Always")
        make_bmc(api, namespace, member.vm)
        member.extra = {"name": member.vm}
    put_pool_secret(api, namespace, members)
    process = PoolProcess(tmp_path, members, source=(
        ["--namespace", namespace, "--pool-secret", "pool-test"], {"KUBECONFIG": sim.kubeconfig}))
    try:
        wait_for(process.ready, timeout=20, what="the pool to be ready")
        second = members[1]
        browser.get(f"http://127.0.0.1:{second.http_port}/")
        until(browser, lambda d: d.find_element(By.ID, "username").is_displayed(), "the login form")
        browser.find_element(By.ID, "username").send_keys(second.entry()["username"])
        browser.find_element(By.ID, "password").send_keys(second.password + Keys.ENTER)
        until(browser, lambda d: power_pill(d) == "Power: On", "the member's VM on")
        until(browser, lambda d: f"{second.vm} login:" in terminal(d), "the member's own serial console")
        until(browser, lambda d: screen(d)[0].endswith(f"{second.vm} login:"), "the member's own screen")
        assert json.loads(json.dumps(browser.execute_script("return kubevbmc.serial"))) == "attached"
    finally:
        assert process.stop() == 0, process.output()[-3000:]
