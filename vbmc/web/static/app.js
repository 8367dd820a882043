// The BMC's page: a Redfish client of its own BMC (as OpenBMC's web UI is). Everything shown is read from
// Redfish, kept live by the EventService's SSE stream; every button is a Redfish call; the consoles are the BMC's
// WebSockets. Built with DOM calls and textContent only (no HTML from data), so nothing the machine or the cluster
// says can become markup.
//
// A session's whole view comes from a <template> when the session starts and is removed when it ends (log out,
// the session deleted or expired, the BMC restarted, the operator idle past the session timeout): before and after,
// the document holds the login form and nothing else.

import { Redfish, errorText } from "/ui/redfish.js";
import { Screen, SerialConsole } from "/ui/consoles.js";

const $ = (id) => document.getElementById(id);

const RESET_LABELS = {
  On: "Power on", ForceOn: "Force on", ForceOff: "Power off", GracefulShutdown: "Shut down",
  GracefulRestart: "Restart", ForceRestart: "Reset", PowerCycle: "Power cycle",
  PushPowerButton: "Press the power button", Pause: "Pause", Resume: "Resume", Nmi: "NMI",
};
// The power actions that make sense in each power state (Redfish's ResetType against PowerState).
const RESETS_IN = {
  On: ["ForceOff", "GracefulShutdown", "GracefulRestart", "ForceRestart", "PowerCycle", "PushPowerButton", "Pause",
    "Nmi"],
  Off: ["On", "ForceOn", "PushPowerButton"],
  Paused: ["Resume", "ForceOff", "ForceRestart"],
  PoweringOn: ["ForceOff"],
  PoweringOff: ["ForceOff"],
};
// The ones that ask first: they cut the machine's power or throw away what it was doing.
const CONFIRM = {
  ForceOff: "Power off the machine now? The guest does not shut down first: unsaved work is lost.",
  ForceRestart: "Reset the machine now? The guest does not shut down first: unsaved work is lost.",
  PowerCycle: "Power cycle the machine now? The guest does not shut down first: unsaved work is lost.",
};
const REFRESH_EVERY = 10000; // ms: a read besides the events'
const MAX_EVENTS = 2000; // kept in the page; the BMC's logs keep their own
const SHOWN_EVENTS = 500;
const SOON = 150; // ms: a burst of events is one read, this long after its last event
// The events after which the sessions view may be out of date: the machine's power changed, and a screen viewer's
// console can end with it (vbmc/machine/screen.py). Logins and consoles opened elsewhere send no event: the
// REFRESH_EVERY read shows them.
const SESSION_EVENTS = new Set(["ResourcePoweredOn", "ResourcePoweredOff", "ResourcePoweringOn",
  "ResourcePoweringOff", "ResourcePaused"]);

const redfish = new Redfish();
let view = null; // what the current session shows and runs; null when nobody is logged in

function element(tag, text, attributes) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) {
    node.textContent = String(text);
  }
  for (const [key, value] of Object.entries(attributes || {})) {
    node.setAttribute(key, value);
  }
  return node;
}

function say(id, text, error) {
  const node = $(id);
  if (!node) {
    return;
  }
  node.textContent = text;
  node.classList.toggle("error", Boolean(error));
}

// One timestamp format everywhere: UTC, to the second.
function when(value) {
  const date = value ? new Date(value) : null;
  if (!date || Number.isNaN(date.getTime())) {
    return value ? String(value) : "";
  }
  return date.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function ask(question, yes) {
  const dialog = $("confirm");
  $("confirm-text").textContent = question;
  $("confirm-yes").textContent = yes;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "yes"), { once: true });
  });
}

async function attempt(messageId, work, done) {
  say(messageId, "…");
  try {
    await work();
    say(messageId, done || "Done.");
  } catch (e) {
    if (e.status === 401) {
      await leave("The session ended: log in again.");
      return;
    }
    say(messageId, e.message, true);
  }
  scheduleRefresh();
}

// ---- logging in and out

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  say("login-error", "");
  $("login").disabled = true;
  try {
    await redfish.login($("username").value, $("password").value);
    $("password").value = "";
    await enter();
  } catch (e) {
    say("login-error", e.status === 401 ? "The user name or password is incorrect." : e.message, true);
  } finally {
    $("login").disabled = false;
  }
});

async function enter() {
  const parts = $("session-template").content.cloneNode(true);
  $("bar").append(parts.querySelector("#summary"));
  $("main").append(parts.querySelector("#idle-warning"), parts.querySelector("#bmc"));
  $("login-section").hidden = true;
  view = { system: null, streaming: null, timers: [], refreshSoon: null, sessionsSoon: null, events: [],
    uploads: new Set(), serial: null, screen: null, idle: { timeout: 0, last: Date.now() } };
  bindSession();
  await refresh();
  if (!view) {
    return;
  }
  const hooks = { onSessionEnded: (why) => leave(`The session ended (${why}): log in again.`),
    onDropped: () => scheduleRefresh() };
  const consoles = view.system.SerialConsole && view.system.SerialConsole.WebSocket;
  if (consoles && consoles.ServiceEnabled) {
    view.serial = new SerialConsole($("terminal"), $("serial-status"), consoles.ConsoleURI, redfish.token, hooks);
  } else {
    say("serial-status", "This machine has no serial console.");
  }
  if (view.system.GraphicalConsole && view.system.GraphicalConsole.ServiceEnabled) {
    view.screen = new Screen($("screen"), $("screen-status"), $("no-signal"), "/consoles/screen", redfish.token,
      hooks);
  } else {
    say("screen-status", "This machine has no screen.");
  }
  follow();
  loadLog();
  showSessions();
  showBmc();
  view.timers.push(setInterval(refresh, REFRESH_EVERY), setInterval(showSessions, REFRESH_EVERY),
    setInterval(checkIdle, 1000));
  $("power-heading").focus();
}

// The session is over: stop everything it started and remove everything it showed.
async function leave(why) {
  const ending = view;
  if (!ending) {
    return;
  }
  view = null;
  for (const timer of ending.timers) {
    clearInterval(timer);
  }
  clearTimeout(ending.refreshSoon);
  clearTimeout(ending.sessionsSoon);
  if (ending.streaming) {
    ending.streaming.abort();
  }
  for (const upload of ending.uploads) {
    upload.abort();
  }
  for (const console of [ending.serial, ending.screen]) {
    if (console) {
      console.dispose();
    }
  }
  if (document.fullscreenElement) {
    document.exitFullscreen().catch(() => null);
  }
  if ($("confirm").open) {
    $("confirm").close("no");
  }
  for (const id of ["summary", "idle-warning", "bmc"]) {
    const node = $(id);
    if (node) {
      node.remove();
    }
  }
  $("title").textContent = "KubeVBMC";
  document.title = "KubeVBMC";
  await redfish.logout();
  $("username").value = "";
  $("password").value = "";
  $("login-section").hidden = false;
  say("login-error", why || "");
  $("username").focus();
}

// ---- the operator's inactivity: the page's own polling is not activity, the operator's input is

const ACTIVITY = ["keydown", "pointerdown", "wheel", "input"];
for (const type of ACTIVITY) {
  window.addEventListener(type, () => {
    if (view) {
      view.idle.last = Date.now();
    }
  }, { capture: true, passive: true });
}

function checkIdle() {
  if (!view || !view.idle.timeout) {
    return;
  }
  const timeout = view.idle.timeout;
  const idle = (Date.now() - view.idle.last) / 1000;
  const left = Math.ceil(timeout - idle);
  const warnBefore = Math.min(60, timeout / 3);
  if (left <= 0) {
    leave(`Logged out after ${timeout} s without activity (the BMC's session timeout).`);
    return;
  }
  const warning = $("idle-warning");
  warning.hidden = left > warnBefore;
  if (!warning.hidden) {
    $("idle-text").textContent = `No activity: you will be logged out in ${left} s.`;
  }
}

// ---- what the BMC says

function scheduleRefresh() {
  if (!view) {
    return;
  }
  clearTimeout(view.refreshSoon);
  view.refreshSoon = setTimeout(refresh, SOON);
}

async function refresh() {
  const current = view;
  if (!current || !redfish.token) {
    return;
  }
  let system;
  try {
    const systems = await redfish.get("/redfish/v1/Systems");
    system = await redfish.get(systems.Members[0]["@odata.id"]);
    const service = await redfish.get("/redfish/v1/SessionService");
    current.idle.timeout = Number(service.SessionTimeout) || 0;
  } catch (e) {
    if (e.status === 401 && view === current) {
      await leave("The session ended (deleted, expired, or the BMC restarted): log in again.");
    }
    return;
  }
  if (view !== current) {
    return;
  }
  current.system = system;
  showSystem(system);
  await Promise.allSettled([showMedia(system), showSecureBoot(system), showInventory(system)]);
}

function showSystem(doc) {
  $("title").textContent = `KubeVBMC — ${doc.Name || doc.Id}`;
  document.title = `${doc.Name || doc.Id} — KubeVBMC`;
  $("power").textContent = `Power: ${doc.PowerState}`;
  $("power").dataset.state = doc.PowerState;
  $("power-state").textContent = doc.PowerState;
  const health = (doc.Status && doc.Status.Health) || "OK";
  $("health").textContent = `Health: ${health}`;
  $("health").dataset.state = health;
  // Identify: the System's LocationIndicatorActive (the same indicator as the Chassis' and IPMI's chassis identify).
  const lit = Boolean(doc.LocationIndicatorActive);
  $("identify").textContent = `Identify: ${lit ? (doc.IndicatorLED === "Blinking" ? "blinking" : "lit") : "off"}`;
  $("identify").dataset.state = lit ? "Lit" : "Off";
  $("identify-toggle").textContent = lit ? "Stop identifying" : "Identify";
  $("identify-toggle").dataset.lit = String(lit);

  const reset = doc.Actions && doc.Actions["#ComputerSystem.Reset"];
  const allowed = (reset && reset["ResetType@Redfish.AllowableValues"]) || [];
  const buttons = $("reset-buttons");
  if (buttons.dataset.types !== allowed.join(",")) {
    buttons.dataset.types = allowed.join(",");
    buttons.replaceChildren(...allowed.map((type) => {
      const label = RESET_LABELS[type] || type;
      const button = element("button", label, { type: "button", "data-reset": type });
      if (CONFIRM[type]) {
        button.classList.add("danger");
      }
      button.addEventListener("click", async () => {
        if (CONFIRM[type] && !await ask(CONFIRM[type], label)) {
          return;
        }
        attempt("power-message", () => redfish.action(reset.target, { ResetType: type }), `${label}: sent.`);
      });
      return button;
    }));
  }
  const fitting = RESETS_IN[doc.PowerState] || [];
  for (const button of buttons.querySelectorAll("button")) {
    button.disabled = !fitting.includes(button.dataset.reset);
  }

  const boot = doc.Boot || {};
  fillSelect($("boot-target"), boot["BootSourceOverrideTarget@Redfish.AllowableValues"] || [],
    boot.BootSourceOverrideTarget);
  fillSelect($("boot-mode"), boot["BootSourceOverrideMode@Redfish.AllowableValues"] || [],
    boot.BootSourceOverrideMode);
  if (document.activeElement !== $("boot-enabled")) {
    $("boot-enabled").value = boot.BootSourceOverrideEnabled || "Disabled";
  }
  if (document.activeElement !== $("boot-uri")) {
    $("boot-uri").value = boot.HttpBootUri || "";
  }
}

function fillSelect(select, values, current) {
  if (select.dataset.values !== values.join(",")) {
    select.dataset.values = values.join(",");
    select.replaceChildren(...values.map((v) => element("option", v, { value: v })));
  }
  if (document.activeElement !== select && current) {
    select.value = current;
  }
}

// ---- the session's controls (bound each time its view is made)

function bindSession() {
  $("logout").addEventListener("click", () => leave("Logged out."));
  $("stay").addEventListener("click", () => {
    view.idle.last = Date.now();
    checkIdle();
  });
  $("boot-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const boot = {
      BootSourceOverrideTarget: $("boot-target").value,
      BootSourceOverrideEnabled: $("boot-enabled").value,
      BootSourceOverrideMode: $("boot-mode").value,
    };
    if (boot.BootSourceOverrideTarget === "UefiHttp") {
      boot.HttpBootUri = $("boot-uri").value || null;
    }
    attempt("boot-message", () => redfish.patch(view.system["@odata.id"], { Boot: boot }),
      "The boot override is set.");
  });
  $("identify-toggle").addEventListener("click", () => {
    const light = $("identify-toggle").dataset.lit !== "true";
    attempt("power-message", () => redfish.patch(view.system["@odata.id"], { LocationIndicatorActive: light }),
      light ? "Identify is on." : "Identify is off.");
  });
  $("secureboot-form").addEventListener("submit", (event) => {
    event.preventDefault();
    attempt("secureboot-message", () => redfish.patch(view.system.SecureBoot["@odata.id"],
      { SecureBootEnable: $("secureboot-enable").checked }), "Secure boot is set for the next boot.");
  });
  $("send-keys").addEventListener("click", () => view.screen && view.screen.sendKeys($("key-macro").value));
  $("fullscreen").addEventListener("click", () => view.screen && view.screen.fullscreen($("screen-frame")));
  $("screenshot").addEventListener("click", () => view.screen && view.screen.screenshot($("screenshot-link")));
  $("paste-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (view.screen) {
      await view.screen.type($("paste-text").value);
    }
  });
  for (const id of ["events-severity", "events-source", "events-search"]) {
    $(id).addEventListener("input", showEvents);
    $(id).addEventListener("change", showEvents);
  }
  $("events-csv").addEventListener("click", () => download("csv"));
  $("events-json").addEventListener("click", () => download("json"));
}

// ---- virtual media

async function showMedia(doc) {
  const box = $("media");
  if (!doc.VirtualMedia) {
    box.replaceChildren(element("p", "This BMC has no virtual media."));
    return;
  }
  const collection = await redfish.get(doc.VirtualMedia["@odata.id"]);
  const slots = await Promise.all(collection.Members.map((m) => redfish.get(m["@odata.id"])));
  if (!view) {
    return;
  }
  for (const slot of slots) {
    let form = box.querySelector(`[data-slot="${CSS.escape(slot.Id)}"]`);
    if (!form) {
      form = mediaForm(slot);
      box.append(form);
    }
    const uploaded = slot.ConnectedVia === "Applet";
    const source = uploaded ? "uploaded from a browser" : slot.ConnectedVia || "inserted";
    const state = slot.Inserted ? `${uploaded ? slot.ImageName || slot.Image : slot.Image} (${source})` : "empty";
    form.querySelector(".media-state").textContent = `${slot.Name || slot.Id}: ${state}`;
    form.querySelector(".eject").disabled = !slot.Inserted;
    const busy = form.dataset.busy === "true";
    form.querySelector(".insert").disabled = slot.Inserted || busy;
    form.querySelector(".upload").disabled = slot.Inserted || busy;
  }
}

const ISO_MAGIC_AT = 32769; // ISO 9660's "CD001", in its first volume descriptor

async function looksLikeIso(file) {
  const magic = await file.slice(ISO_MAGIC_AT, ISO_MAGIC_AT + 5).text();
  return magic === "CD001";
}

function mediaForm(slot) {
  const id = `media-${slot.Id}`;
  const form = element("form", null, { "data-slot": slot.Id, class: "media" });
  const state = element("p", "", { class: "media-state", "aria-live": "polite" });
  const label = element("label", `Image URL for ${slot.Id}`, { for: `${id}-image` });
  const input = element("input", null, { id: `${id}-image`, type: "url", placeholder: "https://…/image.iso",
    autocomplete: "off" });
  const insert = element("button", "Insert", { type: "submit", class: "insert" });
  const eject = element("button", "Eject", { type: "button", class: "eject danger" });
  const fileLabel = element("label", `Or an ISO from this computer for ${slot.Id}`, { for: `${id}-file` });
  const file = element("input", null, { id: `${id}-file`, type: "file", accept: ".iso,application/x-iso9660-image" });
  const upload = element("button", "Upload and insert", { type: "button", class: "upload" });
  const cancel = element("button", "Cancel", { type: "button", class: "cancel secondary" });
  cancel.hidden = true;
  const progress = element("progress", null, { max: "100", value: "0", class: "task-progress",
    "aria-label": `Progress of the ${slot.Id} insert` });
  progress.hidden = true;
  const message = element("p", "", { class: "message task-message", role: "status", "aria-live": "polite" });
  form.append(state, label, input, insert, fileLabel, file, upload, cancel, eject, progress, message);
  const tell = (text, error) => {
    message.textContent = text;
    message.classList.toggle("error", Boolean(error));
  };
  const busy = (on) => {
    form.dataset.busy = String(on);
    insert.disabled = on;
    upload.disabled = on;
    cancel.hidden = !on;
  };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const actions = slot.Actions || {};
    tell("Inserting…");
    progress.hidden = false;
    progress.value = 0;
    busy(true);
    try {
      const answer = await redfish.action(actions["#VirtualMedia.InsertMedia"].target,
        { Image: input.value, Inserted: true, WriteProtected: true });
      const task = await redfish.follow(answer.location, (t) => {
        progress.value = t.PercentComplete || 0;
        tell(`${t.TaskState}: ${t.PercentComplete || 0}%`);
      });
      const said = (task.Messages || []).map((m) => m.Message).join(" ");
      tell(`${task.TaskState}${said ? `: ${said}` : ""}`, task.TaskState !== "Completed");
    } catch (e) {
      tell(e.message, true);
    }
    busy(false);
    scheduleRefresh();
  });
  upload.addEventListener("click", async () => {
    const chosen = file.files && file.files[0];
    if (!chosen) {
      tell("Choose an ISO file first.", true);
      return;
    }
    if (!await looksLikeIso(chosen)) {
      tell(`${chosen.name} is not an ISO 9660 image (no CD001 at byte ${ISO_MAGIC_AT}): nothing was sent.`, true);
      return;
    }
    busy(true);
    progress.hidden = false;
    progress.value = 0;
    tell(`Uploading ${chosen.name}…`);
    const xhr = new XMLHttpRequest();
    view.uploads.add(xhr);
    cancel.onclick = () => xhr.abort();
    xhr.open("POST", `/ui/media/${encodeURIComponent(slot.Id)}/upload?name=${encodeURIComponent(chosen.name)}`);
    xhr.setRequestHeader("X-Auth-Token", redfish.token);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.upload.onprogress = (e) => {
      if (e.lengthComputable) {
        progress.value = Math.floor((100 * e.loaded) / e.total);
        tell(`Uploading ${chosen.name}: ${progress.value}% of ${(e.total / 2 ** 20).toFixed(1)} MiB`);
      }
    };
    const ended = new Promise((resolve) => {
      xhr.onloadend = resolve;
    });
    xhr.send(chosen);
    await ended;
    if (view) {
      view.uploads.delete(xhr);
    }
    busy(false);
    if (xhr.status === 201) {
      progress.value = 100;
      tell(`Inserted: ${chosen.name}.`);
    } else if (xhr.status === 0) {
      tell("The upload was cancelled or the connection failed: nothing was inserted.", true);
    } else {
      let body = null;
      try {
        body = JSON.parse(xhr.responseText);
      } catch (e) {
        body = null;
      }
      if (xhr.status === 401) {
        leave("The session ended: log in again.");
        return;
      }
      tell(errorText(xhr.status, body), true);
    }
    scheduleRefresh();
  });
  eject.addEventListener("click", async () => {
    if (!await ask(`Eject the medium from ${slot.Name || slot.Id}? The machine loses it at once.`, "Eject")) {
      return;
    }
    progress.hidden = true;
    try {
      await redfish.action((slot.Actions || {})["#VirtualMedia.EjectMedia"].target, {});
      tell("Ejected.");
    } catch (e) {
      tell(e.message, true);
    }
    scheduleRefresh();
  });
  return form;
}

// ---- secure boot

async function showSecureBoot(doc) {
  if (!doc.SecureBoot) {
    $("secureboot-state").textContent = "This machine has no secure boot setting.";
    $("secureboot-form").hidden = true;
    return;
  }
  const sb = await redfish.get(doc.SecureBoot["@odata.id"]);
  if (!view) {
    return;
  }
  const current = sb.SecureBootCurrentBoot === null ? "the machine is off" : sb.SecureBootCurrentBoot;
  $("secureboot-state").textContent = `This boot: ${current}. Mode: ${sb.SecureBootMode}.`;
  if (document.activeElement !== $("secureboot-enable")) {
    $("secureboot-enable").checked = Boolean(sb.SecureBootEnable);
  }
}

// ---- inventory and the BMC itself

async function members(link) {
  if (!link) {
    return [];
  }
  const collection = await redfish.get(link["@odata.id"]);
  return Promise.all((collection.Members || []).map((m) => redfish.get(m["@odata.id"])));
}

function facts(list, pairs) {
  list.replaceChildren(...pairs.filter(([, v]) => v).flatMap(([k, v]) => [element("dt", k), element("dd", v)]));
}

async function showInventory(doc) {
  const found = [
    ["Model", `${doc.Manufacturer || ""} ${doc.Model || ""}`.trim()],
    ["Serial number", doc.SerialNumber],
    ["UUID", doc.UUID],
    ["Processors", doc.ProcessorSummary &&
      `${doc.ProcessorSummary.Count} socket(s), ${doc.ProcessorSummary.LogicalProcessorCount} logical`],
    ["Memory", doc.MemorySummary && `${doc.MemorySummary.TotalSystemMemoryGiB} GiB`],
  ];
  const [nics, storages] = await Promise.all([members(doc.EthernetInterfaces), members(doc.Storage)]);
  for (const nic of nics) {
    found.push([`Network ${nic.Id}`, `${nic.MACAddress || "no MAC yet"} (${nic.LinkStatus || ""})`]);
  }
  for (const storage of storages) {
    const drives = await Promise.all((storage.Drives || []).map((d) => redfish.get(d["@odata.id"])));
    for (const drive of drives) {
      const size = drive.CapacityBytes ? `${(drive.CapacityBytes / 2 ** 30).toFixed(1)} GiB` : "size unknown";
      found.push([`Disk ${drive.Id}`, `${drive.MediaType || "disk"}, ${size}`]);
    }
  }
  if (view) {
    facts($("inventory"), found);
  }
}

async function showBmc() {
  try {
    const managers = await redfish.get("/redfish/v1/Managers");
    const manager = await redfish.get(managers.Members[0]["@odata.id"]);
    const protocols = manager.NetworkProtocol ? await redfish.get(manager.NetworkProtocol["@odata.id"]) : {};
    if (!view) {
      return;
    }
    const oem = (manager.Oem && manager.Oem.KubeVBMC) || {};
    const tls = oem.TLS || {};
    const endpoints = oem.Endpoints || {};
    const enabled = ["HTTP", "HTTPS", "IPMI", "SSH", "KVMIP", "VirtualMedia"]
      .filter((p) => protocols[p] && protocols[p].ProtocolEnabled)
      .map((p) => (protocols[p].Port ? `${p} (port ${protocols[p].Port})` : p));
    facts($("bmc-info"), [
      ["Firmware", manager.FirmwareVersion && `KubeVBMC agent ${manager.FirmwareVersion}`],
      ["Protocols", enabled.join(", ")],
      ["Redfish", (endpoints.Redfish || []).join(" ")],
      ["IPMI", endpoints.IPMI],
      ["Certificate SHA-256", tls.CertificateFingerprintSHA256],
      ["CA SHA-256 (pin this)", tls.CAFingerprintSHA256],
      ["Certificate valid until", tls.NotAfter && when(tls.NotAfter)],
    ]);
  } catch (e) {
    say("bmc-info", `The BMC's own information could not be read: ${e.message}`, true);
  }
}

// ---- sessions: who is logged in, on which console

function scheduleSessions() {
  if (!view) {
    return;
  }
  clearTimeout(view.sessionsSoon);
  view.sessionsSoon = setTimeout(showSessions, SOON);
}

async function showSessions() {
  const current = view;
  if (!current) {
    return;
  }
  let sessions;
  try {
    sessions = await members({ "@odata.id": "/redfish/v1/SessionService/Sessions" });
  } catch (e) {
    say("sessions-message", e.message, true);
    return;
  }
  if (view !== current) {
    return;
  }
  const rows = sessions.map((s) => {
    const oem = (s.Oem && s.Oem.KubeVBMC) || {};
    const consoles = (oem.Consoles || []).map((c) => `${c.Console} from ${c.ClientOriginIPAddress} since ` +
      `${when(c.Since)}`).join("; ");
    const row = element("tr", null, { "data-session": s.Id });
    row.append(element("td", s.UserName), element("td", s.ClientOriginIPAddress || ""),
      element("td", when(s.CreatedTime)), element("td", s.SessionType || ""), element("td", consoles || "none"));
    const cell = element("td");
    if (oem.Current) {
      cell.textContent = "this session";
    } else {
      const end = element("button", "End", { type: "button", class: "danger",
        "aria-label": `End the session of ${s.UserName} from ${s.ClientOriginIPAddress || "unknown"}` });
      end.addEventListener("click", async () => {
        if (!await ask(`End the session of ${s.UserName} (${s.ClientOriginIPAddress || "unknown address"})? Its ` +
          "consoles close.", "End the session")) {
          return;
        }
        await attempt("sessions-message", () => redfish.request("DELETE", s["@odata.id"]), "The session ended.");
        showSessions();
      });
      cell.append(end);
    }
    row.append(cell);
    return row;
  });
  $("sessions").tBodies[0].replaceChildren(...rows);
}

// ---- events: the SSE stream, and the log services the BMC has

function addEvent(time, severity, source, message, origin) {
  view.events.push({ time: when(time), severity: severity || "", source, message: message || "",
    origin: origin || "" });
  if (view.events.length > MAX_EVENTS) {
    view.events.splice(0, view.events.length - MAX_EVENTS);
  }
}

function filtered() {
  const severity = $("events-severity").value;
  const source = $("events-source").value;
  const needle = $("events-search").value.trim().toLowerCase();
  return view.events.filter((e) => (!severity || e.severity === severity) && (!source || e.source === source) &&
    (!needle || `${e.time} ${e.severity} ${e.source} ${e.message} ${e.origin}`.toLowerCase().includes(needle)))
    .sort((a, b) => (a.time < b.time ? 1 : a.time > b.time ? -1 : 0));
}

function showEvents() {
  if (!view) {
    return;
  }
  const shown = filtered();
  const rows = shown.slice(0, SHOWN_EVENTS).map((e) => {
    const row = element("tr");
    row.append(element("td", e.time), element("td", e.severity), element("td", e.source),
      element("td", e.origin ? `${e.message} (${e.origin})` : e.message));
    return row;
  });
  $("events").tBodies[0].replaceChildren(...rows);
  $("events-count").textContent = `${shown.length} of ${view.events.length} events` +
    (shown.length > SHOWN_EVENTS ? ` (the newest ${SHOWN_EVENTS} shown; the download has all)` : "");
}

function download(format) {
  const rows = filtered();
  const fields = ["time", "severity", "source", "message", "origin"];
  const quote = (v) => `"${String(v).replace(/"/g, '""')}"`;
  const text = format === "json" ? JSON.stringify(rows, null, 1)
    : [fields.join(","), ...rows.map((r) => fields.map((f) => quote(r[f])).join(","))].join("\r\n");
  const blob = new Blob([text], { type: format === "json" ? "application/json" : "text/csv" });
  const link = $("events-link");
  const url = URL.createObjectURL(blob);
  link.href = url;
  const stamp = when(Date.now()).replace(/[: ]/g, "-");
  link.download = `events-${(view.system && view.system.Id) || "bmc"}-${stamp}.${format}`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function follow() {
  const current = view;
  const controller = new AbortController();
  current.streaming = controller;
  while (view === current && current.streaming === controller) {
    try {
      say("events-status", "Following the BMC's events (EventService, server-sent events).");
      await redfish.events((event) => {
        if (view !== current) {
          return;
        }
        const records = event.Events || [];
        for (const record of records) {
          const origin = record.OriginOfCondition && record.OriginOfCondition["@odata.id"];
          addEvent(record.EventTimestamp, record.MessageSeverity || record.Severity, "Events", record.Message,
            origin);
        }
        showEvents();
        scheduleRefresh();
        if (records.some((r) => SESSION_EVENTS.has(String(r.MessageId || "").split(".").pop()))) {
          scheduleSessions();
        }
      }, controller.signal);
    } catch (e) {
      if (view !== current || current.streaming !== controller) {
        return;
      }
      say("events-status", `The event stream stopped (${e.message}); following again…`, true);
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function loadLog() {
  // The LogServices the BMC has (its SEL and audit log), on the System or the Manager.
  const current = view;
  try {
    const managers = await redfish.get("/redfish/v1/Managers");
    const manager = await redfish.get(managers.Members[0]["@odata.id"]);
    const services = [...await members(current.system.LogServices), ...await members(manager.LogServices)];
    for (const service of services) {
      // A LogEntryCollection's Members are whole entries (vbmc/redfish/logs.py): one read per log.
      const entries = service.Entries ? (await redfish.get(service.Entries["@odata.id"])).Members || [] : [];
      if (view !== current) {
        return;
      }
      const source = /audit/i.test(`${service.Id} ${service.Name}`) ? "Audit" : "SEL";
      for (const entry of entries) {
        addEvent(entry.Created, entry.Severity, source, entry.Message, "");
      }
    }
  } catch (e) {
    // none: the live events are what there is
  }
  showEvents();
}

// For the tests and for people at the browser's console: the page's state, read-only.
window.kubevbmc = {
  get serial() { return view && view.serial ? view.serial.state : "closed"; },
  get screen() { return view && view.screen ? view.screen.state : "closed"; },
  get loggedIn() { return Boolean(view); },
  serialText() { return view && view.serial ? view.serial.text() : ""; },
};

$("username").focus();
