"""The BMC's page in a real browser (headless Chromium, tests/support/browser.py) against agents on kubesim: log in,
watch power change when ipmitool powers the VM on, read the serial login prompt and type a line that echoes, see the
screen show the boot and change after a reset, insert an image and watch its task complete, power off from the
page, light identify and see IPMI turn it off, log out and see the consoles close; on a narrow screen too, and
for a member of a pooled agent."""

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
from selenium.webdriver.support.ui import Select, WebDriverWait

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, free_port, write_serving_certificate
from ..support.browser import chromium, console_errors, screenshot
from ..support.cluster import Sim, wait_for
from ..support.rfb import screen_text
from ..support.vms import get_vm, printable

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


LOGIN_ONLY = {"bar", "title", "main", "login-section", "login-heading", "login-form", "username", "password", "login",
              "login-error"}
DISPLAYED_IDS = """
return [...document.querySelectorAll('[id]')]
  .filter(e => e.getClientRects().length && getComputedStyle(e).visibility !== 'hidden').map(e => e.id);"""


def displayed(driver: Any) -> set[str]:
    """The ids of the elements the page shows (laid out and visible)."""
    return set(driver.execute_script(DISPLAYED_IDS))


def page_source(driver: Any) -> str:
    """Everything the document holds, markup, text and form values."""
    return str(driver.execute_script("""
        return document.documentElement.outerHTML + document.body.innerText
          + [...document.querySelectorAll('input, textarea')].map(e => e.value).join(' ');"""))


def assert_login_only(driver: Any) -> None:
    """Only the login form: no session element exists, none is displayed."""
    assert displayed(driver) <= LOGIN_ONLY, displayed(driver) - LOGIN_ONLY
    assert driver.execute_script("return ['bmc', 'summary', 'terminal', 'screen', 'events'].filter(id => "
                                 "document.getElementById(id))") == []


def confirm(driver: Any) -> None:
    until(driver, lambda d: d.find_element(By.ID, "confirm").is_displayed(), "the confirmation dialog")
    driver.find_element(By.ID, "confirm-yes").click()


def log_in(driver: Any, url: str) -> None:
    driver.get(url)
    until(driver, lambda d: d.find_element(By.ID, "username").is_displayed(), "the login form")
    assert_login_only(driver)
    driver.find_element(By.ID, "username").send_keys(USER)
    driver.find_element(By.ID, "password").send_keys(PASSWORD + Keys.ENTER)
    until(driver, lambda d: d.find_element(By.ID, "bmc").is_displayed(), "the BMC's sections after logging in")


def power_pill(driver: Any) -> str:
    return text_of(driver, "#power")


def terminal(driver: Any) -> str:
    """The serial terminal's text (its buffer: xterm.js draws only rows that are on screen)."""
    return str(driver.execute_script("return kubevbmc.serialText()"))


def enabled_resets(driver: Any) -> set[str]:
    return set(driver.execute_script(
        "return [...document.querySelectorAll('[data-reset]')].filter(b => !b.disabled).map(b => b.dataset.reset)"))


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
    until(browser, lambda d: enabled_resets(d) == {"On", "ForceOn", "PushPowerButton"},
          "only the power actions of a machine that is off enabled")

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
    until(browser, lambda d: "ForceRestart" in enabled_resets(d) and "On" not in enabled_resets(d),
          "the power actions of a machine that is on")
    browser.find_element(By.CSS_SELECTOR, '[data-reset="ForceRestart"]').click()
    confirm(browser)
    until(browser, lambda d: (lambda text, lit: lit > 0 and text.endswith("vm login:") and "hello" not in text)(
        *screen(d)), "the screen redrawn by the reset")
    assert "the machine is off" not in text_of(browser, "#screen-status")

    # Ctrl-Alt-Del reaches the guest (it reboots: the serial line says so), and the screen can be saved.
    Select(browser.find_element(By.ID, "key-macro")).select_by_value("ctrl-alt-del")
    browser.find_element(By.ID, "send-keys").click()
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
    assert printable(api, namespace) == "Running"  # it asks first
    browser.find_element(By.ID, "confirm-no").click()
    assert not browser.find_element(By.ID, "confirm").is_displayed()
    browser.find_element(By.CSS_SELECTOR, '[data-reset="ForceOff"]').click()
    confirm(browser)
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=20, what="the VM stopped")
    until(browser, lambda d: power_pill(d) == "Power: Off", "the VM shown off again")
    until(browser, lambda d: "not available" in text_of(d, "#serial-status"), "the serial console told of it")
    until(browser, lambda d: "not available" in text_of(d, "#screen-status"), "the screen told of it")
    until(browser, lambda d: text_of(d, "#no-signal").startswith("No signal"), "no signal inside the viewer")

    # Power on again from the page: both consoles come back by themselves, on the new VMI.
    browser.find_element(By.CSS_SELECTOR, '[data-reset="On"]').click()
    until(browser, lambda d: text_of(d, "#screen-status") == "Connected to the screen.", "the screen back",
          timeout=40)
    until(browser, lambda d: screen(d)[0].endswith("vm login:"), "the new boot's prompt on the screen")
    until(browser, lambda d: text_of(d, "#serial-status") == "Connected to the serial console.", "the line back")

    assert not browser.find_element(By.ID, "no-signal").is_displayed()

    # Logging out closes both consoles and leaves nothing of the session in the page.
    browser.find_element(By.ID, "logout").click()
    until(browser, lambda d: d.find_element(By.ID, "login-section").is_displayed(), "the login form again")
    until(browser, lambda d: d.execute_script("return [kubevbmc.serial, kubevbmc.screen]") == ["closed", "closed"],
          "both consoles closed")
    wait_for(lambda: agent.output().count("console' vm=vm result='closed:") >= 2, what="the audit lines")
    assert_login_only(browser)
    left = page_source(browser)
    for trace in ("vm login", "operator", image, "has powered on", "127.0.0.1", USER):
        assert trace not in left, f"{trace!r} is still in the page after logging out"
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


# ---- the session's end, refusals, the keyboard, the consoles' reconnection


def own_session(driver: Any, agent: AgentProcess) -> str:
    """The @odata.id of the page's session: the newest one the BMC lists."""
    status, sessions = agent.redfish("GET", "/redfish/v1/SessionService/Sessions")
    assert status == 200
    return str(sessions["Members"][-1]["@odata.id"])


def test_a_session_deleted_through_redfish_takes_everything_off_the_page(agent: AgentProcess, browser: Any,
                                                                         api: client.ApiClient,
                                                                         namespace: str) -> None:
    # The machine boots while nobody watches: the first viewer is greeted with what it printed, without typing.
    assert agent.ipmitool("power", "on").returncode == 0
    wait_for(lambda: printable(api, namespace) == "Running", timeout=20, what="the VM running")
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: "vm login:" in terminal(d), "the boot's output shown to the first viewer")
    until(browser, lambda d: "has powered on" in text_of(d, "#events") or "powered on" in text_of(d, "#events")
          or len(d.find_elements(By.CSS_SELECTOR, "#events tbody tr")) > 0, "the event log filled")
    session = own_session(browser, agent)

    assert agent.redfish("DELETE", session)[0] == 204  # an administrator ends it elsewhere

    until(browser, lambda d: d.find_element(By.ID, "login-section").is_displayed(), "the login form again")
    until(browser, lambda d: "session ended" in text_of(d, "#login-error"), "why the page logged out")
    assert_login_only(browser)
    left = page_source(browser)
    for trace in ("vm login", "127.0.0.1", "Power: On", USER):
        assert trace not in left, f"{trace!r} is still in the page after its session ended"
    wait_for(lambda: browser.execute_script("return [kubevbmc.serial, kubevbmc.screen]") == ["closed", "closed"],
             what="both consoles closed")


def test_a_refusal_shows_the_bmcs_own_message(agent: AgentProcess, browser: Any) -> None:
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    unreachable = f"http://127.0.0.1:{free_port()}/nothing-here.iso"  # nothing listens there
    status, answer = agent.redfish("POST", "/redfish/v1/Managers/BMC/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
                                   {"Image": unreachable, "Inserted": True})
    assert status == 400, answer
    expected = answer["error"]["message"]
    assert "cannot be reached" in expected or "refused" in expected.lower(), expected

    until(browser, lambda d: d.find_elements(By.ID, "media-Cd-image"), "the media form")
    browser.find_element(By.ID, "media-Cd-image").send_keys(unreachable)
    browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] .insert').click()
    until(browser, lambda d: text_of(d, '[data-slot="Cd"] .task-message') == expected, "the BMC's own reason")
    assert "error" in browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] .task-message').get_attribute("class")
    screenshot(browser, "page-refusal")


def identify_annotation(api: client.ApiClient, namespace: str) -> str | None:
    annotations = (get_vm(api, namespace)["metadata"].get("annotations") or {})
    return annotations.get("bmc.kubevirt.io/identify")


def test_identify_from_the_page_is_the_one_ipmi_and_redfish_see(agent: AgentProcess, browser: Any,
                                                                 api: client.ApiClient, namespace: str) -> None:
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: text_of(d, "#identify") == "Identify: off", "identify shown off")
    assert identify_annotation(api, namespace) is None

    browser.find_element(By.ID, "identify-toggle").click()
    until(browser, lambda d: text_of(d, "#identify") == "Identify: lit", "identify shown lit")
    assert agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["LocationIndicatorActive"] is True
    assert agent.redfish("GET", "/redfish/v1/Chassis/vm")[1]["LocationIndicatorActive"] is True
    assert identify_annotation(api, namespace) == "on"  # kept in the cluster, beside the VM
    assert browser.find_element(By.ID, "identify-toggle").text == "Stop identifying"

    # Turned off by another client (IPMI), the page follows without a reload.
    assert agent.ipmitool("chassis", "identify", "0").returncode == 0
    until(browser, lambda d: text_of(d, "#identify") == "Identify: off", "the page following IPMI's identify off")
    assert identify_annotation(api, namespace) is None
    assert browser.find_element(By.ID, "identify-toggle").text == "Identify"


def test_the_keyboard_leaves_the_terminal_and_reaches_the_screen(agent: AgentProcess, browser: Any) -> None:
    assert agent.ipmitool("power", "on").returncode == 0
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: "vm login:" in terminal(d), "the serial login prompt")
    until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#screen canvas"), "the screen")
    textarea = browser.find_element(By.CSS_SELECTOR, "#terminal textarea")
    textarea.click()
    assert browser.execute_script("return document.activeElement.classList.contains('xterm-helper-textarea')")
    reached = []
    for _ in range(12):
        browser.switch_to.active_element.send_keys(Keys.TAB)
        reached.append(browser.execute_script(
            "const e = document.activeElement; return e.tagName === 'CANVAS' ? 'screen' : (e.id || e.tagName)"))
        if reached[-1] == "screen":
            break
    assert reached[0] != "TEXTAREA", "Tab stayed in the terminal"
    assert reached[-1] == "screen", reached
    assert "\t" not in terminal(browser)  # the Tabs left; none was typed on the line
    # On the screen, Tab is the machine's; Shift-Tab leaves.
    browser.switch_to.active_element.send_keys(Keys.TAB)
    assert browser.execute_script("return document.activeElement.tagName") == "CANVAS"
    browser.switch_to.active_element.send_keys(Keys.SHIFT, Keys.TAB)
    assert browser.execute_script("return document.activeElement.tagName") != "CANVAS"


def test_the_viewer_cap_names_itself_and_the_console_comes_back_when_a_slot_frees(
        agent: AgentProcess, browser: Any, tmp_path: Path) -> None:
    import ssl

    import websocket

    assert agent.ipmitool("power", "on").returncode == 0
    status, _ = agent.redfish("GET", "/redfish/v1")
    assert status == 200
    token = agent_token(agent)
    https = agent.page.rstrip("/").replace("https://", "wss://")  # type: ignore[attr-defined]
    tls = ssl.create_default_context()
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    others = [websocket.create_connection(f"{https}/consoles/serial", subprotocols=["kubevbmc",
                                                                                    f"x-auth-token.{token}"],
                                          sslopt={"context": tls}, timeout=10) for _ in range(4)]
    try:
        log_in(browser, agent.page)  # type: ignore[attr-defined]
        until(browser, lambda d: "viewers" in text_of(d, "#serial-status"), "the cap named in the console's status")
        assert "1013" in text_of(browser, "#serial-status")
        screenshot(browser, "page-viewer-cap")
        others.pop().close()
        until(browser, lambda d: d.execute_script("return kubevbmc.serial") == "attached",
              "the console attached by itself once a slot freed", timeout=40)
    finally:
        for other in others:
            other.close()


def agent_token(agent: AgentProcess) -> str:
    """A Redfish session token of the agent's (over plain HTTP: its Redfish API answers there)."""
    import urllib.request

    req = urllib.request.Request(f"{agent.url}/redfish/v1/SessionService/Sessions", method="POST",
                                 data=json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.headers["X-Auth-Token"])


def test_the_event_log_filters_searches_and_downloads(agent: AgentProcess, browser: Any, tmp_path: Path) -> None:
    assert agent.ipmitool("power", "on").returncode == 0
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: len(event_rows(d)) >= 2, "events of more than one kind")
    sources = {row[2] for row in event_rows(browser)}
    assert {"SEL", "Audit"} <= sources, sources
    Select(browser.find_element(By.ID, "events-source")).select_by_value("Audit")
    until(browser, lambda d: {row[2] for row in event_rows(d)} == {"Audit"}, "only audit rows")
    audit_rows = event_rows(browser)
    word = max(audit_rows[-1][3].split(), key=len)  # a word of the oldest audit row's message
    browser.find_element(By.ID, "events-search").send_keys(word)
    until(browser, lambda d: event_rows(d) and all(word.lower() in " ".join(row).lower() for row in event_rows(d)),
          f"only the rows that mention {word!r}")
    rows = event_rows(browser)
    for row in rows:  # one timestamp format: UTC to the second
        assert len(row[0]) == 20 and row[0][10] == " " and row[0].endswith("Z"), row[0]
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    browser.find_element(By.ID, "events-json").click()
    saved = wait_for(lambda: [p for p in tmp_path.glob("events-*.json") if p.stat().st_size], timeout=20,
                     what="the JSON download")
    downloaded = json.loads(saved[0].read_text())
    assert [[e["time"], e["severity"], e["source"], e["message"]] for e in downloaded] == [row[:4] for row in rows]
    browser.find_element(By.ID, "events-csv").click()
    saved = wait_for(lambda: [p for p in tmp_path.glob("events-*.csv") if p.stat().st_size], timeout=20,
                     what="the CSV download")
    lines = saved[0].read_text().strip().splitlines()
    assert lines[0] == "time,severity,source,message,origin"
    assert len(lines) == len(rows) + 1


READS = "return performance.getEntriesByType('resource').map(e => new URL(e.name).pathname)"
SESSIONS = "/redfish/v1/SessionService/Sessions"


def reads(driver: Any) -> list[str]:
    """The paths of every request the page has had answered, in the browser's own count (Resource Timing)."""
    return [str(path) for path in driver.execute_script(READS)]


CHANGED = "One or more resource properties have changed."


def rows_saying(driver: Any, words: str) -> int:
    return sum(row[3].startswith(words) for row in event_rows(driver))


def test_the_log_is_one_read_per_log_and_only_power_events_read_the_sessions_again(agent: AgentProcess,
                                                                                   browser: Any) -> None:
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": "performance.setResourceTimingBufferSize(100000);"})
    assert agent.ipmitool("power", "on").returncode == 0  # entries in both logs
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: {"SEL", "Audit"} <= {row[2] for row in event_rows(d)}, "the SEL's and the audit log's")
    until(browser, lambda d: power_pill(d) == "Power: On", "the VM shown on: its power events are in")
    # A LogEntryCollection's Members are whole entries: the collection is the one read, never an entry of it.
    logs = [path for path in reads(browser) if "/LogServices/" in path and "/Entries" in path]
    assert len(logs) == 2 and all(path.endswith("/Entries") for path in logs), logs

    # Counted from just after the page's periodic read of the sessions (every 10 s): none of those falls in what
    # follows. After events the page's refresh (SessionService last) has the delay a read of the sessions has: once
    # it is in, that read would be too.
    periodic = reads(browser).count(SESSIONS)
    wait_for(lambda: reads(browser).count(SESSIONS) > periodic, timeout=15, what="the periodic read of the sessions")
    sessions, service = reads(browser).count(SESSIONS), reads(browser).count("/redfish/v1/SessionService")
    _, systems = agent.redfish("GET", "/redfish/v1/Systems")
    system = systems["Members"][0]["@odata.id"]
    changed = rows_saying(browser, CHANGED)
    for target in ("Pxe", "Hdd", "Pxe", "Hdd", "Pxe"):  # five boot overrides: five property changes, no session's
        status, answer = agent.redfish("PATCH", system, {"Boot": {"BootSourceOverrideTarget": target,
                                                                  "BootSourceOverrideEnabled": "Continuous"}})
        assert status in (200, 204), answer
    until(browser, lambda d: rows_saying(d, CHANGED) >= changed + 5, "the five changes shown")
    wait_for(lambda: reads(browser).count("/redfish/v1/SessionService") > service, what="the page's refresh")
    assert reads(browser).count(SESSIONS) == sessions

    # A power change may end a screen viewer's console: the sessions are read again, at most once per power event.
    wait_for(lambda: reads(browser).count(SESSIONS) > sessions, timeout=15, what="the periodic read of the sessions")
    sessions, powered = reads(browser).count(SESSIONS), rows_saying(browser, "The resource")
    status, answer = agent.redfish("POST", f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "ForceOff"})
    assert status in (200, 202, 204), answer
    until(browser, lambda d: power_pill(d) == "Power: Off", "the VM shown off")
    wait_for(lambda: reads(browser).count(SESSIONS) > sessions, what="the sessions read after the power change")
    assert reads(browser).count(SESSIONS) - sessions <= rows_saying(browser, "The resource") - powered


def event_rows(driver: Any) -> list[list[str]]:
    return [list(row) for row in driver.execute_script(
        "return [...document.querySelectorAll('#events tbody tr')].map(r => [...r.cells].map(c => c.innerText))")]


# ---- who is logged in; an operator who walks away


def test_the_sessions_view_shows_who_watches_and_ends_a_session(agent: AgentProcess, browser: Any) -> None:
    import ssl
    import urllib.error
    import urllib.request

    import websocket

    assert agent.ipmitool("power", "on").returncode == 0
    other = agent_token(agent)  # another operator, watching the serial console
    tls = ssl.create_default_context()
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    https = agent.page.rstrip("/").replace("https://", "wss://")  # type: ignore[attr-defined]
    watcher = websocket.create_connection(f"{https}/consoles/serial",
                                          subprotocols=["kubevbmc", f"x-auth-token.{other}"],
                                          sslopt={"context": tls}, timeout=10)
    try:
        log_in(browser, agent.page)  # type: ignore[attr-defined]
        until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")) >= 2, "both sessions")
        rows = {row[3]: row for row in session_rows(browser)}
        assert set(rows) >= {"WebUI", "Redfish"}, rows
        assert rows["WebUI"][5] == "this session" and rows["WebUI"][0] == USER
        until(browser, lambda d: any(r[3] == "Redfish" and "serial from 127.0.0.1" in r[4] for r in session_rows(d)),
              "the other operator's serial console")
        screenshot(browser, "page-sessions")

        browser.find_element(By.CSS_SELECTOR, "#sessions tbody button").click()  # the other's: the page's has none
        confirm(browser)
        until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")) == 1,
              "only the page's own session left")
        request = urllib.request.Request(f"{agent.url}/redfish/v1/Systems", headers={"X-Auth-Token": other})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401  # its token is dead
        closed = wait_for(lambda: closed_with(watcher), timeout=20, what="the other's console closed")
        assert closed == 1008
        wait_for(lambda: "ended session" in agent.output(), what="the audit line of who ended whose session")
    finally:
        watcher.close()


def closed_with(ws: Any) -> int | None:
    """The close code once the server closed `ws` (None while it is open)."""
    import websocket

    ws.settimeout(0.5)
    try:
        opcode, data = ws.recv_data(control_frame=True)
    except websocket.WebSocketTimeoutException:
        return None
    except websocket.WebSocketConnectionClosedException:
        return -1
    if opcode == websocket.ABNF.OPCODE_CLOSE:
        return int.from_bytes(data[:2], "big") if len(data) >= 2 else 1005
    return None


def session_rows(driver: Any) -> list[list[str]]:
    return [list(row) for row in driver.execute_script(
        "return [...document.querySelectorAll('#sessions tbody tr')].map(r => [...r.cells].map(c => c.innerText))")]


def test_an_idle_operator_is_warned_then_logged_out_after_the_session_timeout(agent: AgentProcess,
                                                                              browser: Any) -> None:
    status, answer = agent.redfish("PATCH", "/redfish/v1/SessionService", {"SessionTimeout": 30})  # DMTF's least
    assert status == 200, answer
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: d.find_element(By.ID, "idle-warning").is_displayed(), "the warning", timeout=40)
    assert "logged out in" in text_of(browser, "#idle-warning")
    screenshot(browser, "page-idle-warning")
    browser.find_element(By.ID, "stay").click()  # the operator is back
    assert not browser.find_element(By.ID, "idle-warning").is_displayed()
    assert browser.execute_script("return kubevbmc.loggedIn")
    until(browser, lambda d: d.find_element(By.ID, "login-section").is_displayed(), "logged out for inactivity",
          timeout=60)
    assert "without activity" in text_of(browser, "#login-error")
    assert_login_only(browser)
    status, sessions = agent.redfish("GET", "/redfish/v1/SessionService/Sessions")
    assert status == 200 and sessions["Members"] == []  # the page deleted its session on the BMC too


# ---- an ISO from the operator's own disk

UPLOAD_SIZE = 300 * 2**20
UPLOAD_RSS_GROWTH = 48 * 2**20  # the agent's memory while it streams 300 MB through: chunks, never the file


def iso_file(path: Path, size: int) -> Path:
    """A file an ISO 9660 reader takes for one (its primary volume descriptor at 32 KiB), `size` bytes, mostly sparse
    with a few MiB of random bytes spread through it."""
    import os

    with path.open("wb") as f:
        f.truncate(size)
        f.seek(16 * 2048)
        f.write(b"\x01CD001\x01" + bytes(2041))
        for offset in range(2**20, size, size // 8):
            f.seek(offset)
            f.write(os.urandom(2**20))
    return path


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_an_iso_from_the_operators_disk_is_uploaded_and_the_vm_gets_it(agent: AgentProcess, browser: Any,
                                                                       api: client.ApiClient, namespace: str,
                                                                       tmp_path: Path) -> None:
    import threading
    import time

    iso = iso_file(tmp_path / "installer.iso", UPLOAD_SIZE)
    not_iso = tmp_path / "notes.iso"
    not_iso.write_bytes(b"not an image" * 10000)
    log_in(browser, agent.page)  # type: ignore[attr-defined]
    until(browser, lambda d: d.find_elements(By.ID, "media-Cd-file"), "the media form")

    # A file that is not an ISO image is turned down in the page: nothing is sent.
    browser.find_element(By.ID, "media-Cd-file").send_keys(str(not_iso))
    browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] .upload').click()
    until(browser, lambda d: "not an ISO 9660 image" in text_of(d, '[data-slot="Cd"] .task-message'),
          "the refusal of a file that is not an ISO")
    assert "POST /ui/media" not in agent.output()

    pid = agent.proc.pid
    before = rss(pid)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], rss(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        browser.find_element(By.ID, "media-Cd-file").send_keys(str(iso))
        browser.find_element(By.CSS_SELECTOR, '[data-slot="Cd"] .upload').click()
        until(browser, lambda d: "Uploading installer.iso" in text_of(d, '[data-slot="Cd"] .task-message'),
              "the upload's progress")
        until(browser, lambda d: text_of(d, '[data-slot="Cd"] .task-message') == "Inserted: installer.iso.",
              "the upload inserted", timeout=300)
    finally:
        stop.set()
        sampler.join(timeout=5)
    took = time.monotonic() - started
    print(f"upload of {UPLOAD_SIZE >> 20} MiB through the page: {took:.1f} s, agent RSS {before >> 20} MiB -> peak "
          f"{peak[0] >> 20} MiB")
    assert peak[0] - before < UPLOAD_RSS_GROWTH, (before, peak[0])
    until(browser, lambda d: "installer.iso (uploaded from a browser)" in text_of(d, '[data-slot="Cd"] .media-state'),
          "the medium shown inserted from the browser")
    status, medium = agent.redfish("GET", "/redfish/v1/Managers/BMC/VirtualMedia/Cd")
    assert status == 200 and medium["Inserted"] is True and medium["ConnectedVia"] == "Applet", medium
    vm = client.CustomObjectsApi(api).get_namespaced_custom_object("kubevirt.io", "v1", namespace,
                                                                   "virtualmachines", "vm")
    volumes = vm["spec"]["template"]["spec"]["volumes"]
    assert any("dataVolume" in v for v in volumes), volumes  # the VM's CD-ROM is the uploaded DataVolume
    screenshot(browser, "page-upload")
