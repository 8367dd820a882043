// The BMC's page: a Redfish client of its own BMC (as OpenBMC's web UI is). Everything shown is read from
// Redfish, kept live by the EventService's SSE stream; every button is a Redfish call; the consoles are the BMC's
// WebSockets. Built with DOM calls and textContent only (no HTML from data), so nothing the machine or the cluster
// says can become markup.

import { Redfish } from "/ui/redfish.js";
import { Screen, SerialConsole } from "/ui/consoles.js";

const $ = (id) => document.getElementById(id);

const RESET_LABELS = {
  On: "Power on", ForceOn: "Force on", ForceOff: "Power off", GracefulShutdown: "Shut down",
  GracefulRestart: "Restart", ForceRestart: "Reset", PowerCycle: "Power cycle",
  PushPowerButton: "Press the power button", Pause: "Pause", Resume: "Resume", Nmi: "NMI",
};
const REFRESH_EVERY = 10000; // ms: a read besides the events' (and the session stays alive)

const redfish = new Redfish();
const serial = new SerialConsole($("terminal"), $("serial-status"));
const screen = new Screen($("screen"), $("screen-status"));
let system = null;
let streaming = null;
let refreshTimer = null;
let refreshSoon = null;

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
  node.textContent = text;
  node.classList.toggle("error", Boolean(error));
}

async function attempt(messageId, work, done) {
  say(messageId, "…");
  try {
    await work();
    say(messageId, done || "Done.");
  } catch (e) {
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

$("logout").addEventListener("click", () => leave("Logged out."));

async function enter() {
  $("login-section").hidden = true;
  $("bmc").hidden = false;
  $("summary").hidden = false;
  await refresh();
  const consoles = system.SerialConsole && system.SerialConsole.WebSocket;
  if (consoles && consoles.ServiceEnabled) {
    serial.open(consoles.ConsoleURI, redfish.token);
  } else {
    say("serial-status", "This machine has no serial console.");
  }
  if (system.GraphicalConsole && system.GraphicalConsole.ServiceEnabled) {
    screen.open("/consoles/screen", redfish.token);
  } else {
    say("screen-status", "This machine has no screen.");
  }
  follow();
  loadLog();
  refreshTimer = setInterval(refresh, REFRESH_EVERY);
  $("power-heading").focus();
}

async function leave(why) {
  clearInterval(refreshTimer);
  if (streaming) {
    streaming.abort();
    streaming = null;
  }
  serial.close();
  screen.close();
  await redfish.logout();
  $("bmc").hidden = true;
  $("summary").hidden = true;
  $("login-section").hidden = false;
  say("login-error", why || "");
  $("username").focus();
}

// ---- what the BMC says

function scheduleRefresh() {
  clearTimeout(refreshSoon);
  refreshSoon = setTimeout(refresh, 150);
}

async function refresh() {
  if (!redfish.token) {
    return;
  }
  try {
    const systems = await redfish.get("/redfish/v1/Systems");
    system = await redfish.get(systems.Members[0]["@odata.id"]);
  } catch (e) {
    if (e.status === 401) {
      await leave("The session ended: log in again.");
    }
    return;
  }
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

  const reset = doc.Actions && doc.Actions["#ComputerSystem.Reset"];
  const allowed = (reset && reset["ResetType@Redfish.AllowableValues"]) || [];
  const buttons = $("reset-buttons");
  if (buttons.dataset.types !== allowed.join(",")) {
    buttons.dataset.types = allowed.join(",");
    buttons.replaceChildren(...allowed.map((type) => {
      const button = element("button", RESET_LABELS[type] || type, { type: "button", "data-reset": type });
      button.addEventListener("click", () => attempt("power-message",
        () => redfish.action(reset.target, { ResetType: type }), `${RESET_LABELS[type] || type}: sent.`));
      return button;
    }));
  }

  const boot = doc.Boot || {};
  fillSelect($("boot-target"), boot["BootSourceOverrideTarget@Redfish.AllowableValues"] || [],
    boot.BootSourceOverrideTarget);
  fillSelect($("boot-mode"), boot["BootSourceOverrideMode@Redfish.AllowableValues"] || [],
    boot.BootSourceOverrideMode);
  if (document.activeElement !== $("boot-enabled")) {
    $("boot-enabled").value = boot.BootSourceOverrideEnabled || "Disabled";
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

$("boot-form").addEventListener("submit", (event) => {
  event.preventDefault();
  attempt("boot-message", () => redfish.patch(system["@odata.id"], { Boot: {
    BootSourceOverrideTarget: $("boot-target").value,
    BootSourceOverrideEnabled: $("boot-enabled").value,
    BootSourceOverrideMode: $("boot-mode").value,
  } }), "The boot override is set.");
});

// ---- virtual media

async function showMedia(doc) {
  const box = $("media");
  if (!doc.VirtualMedia) {
    box.replaceChildren(element("p", "This BMC has no virtual media."));
    return;
  }
  const collection = await redfish.get(doc.VirtualMedia["@odata.id"]);
  const slots = await Promise.all(collection.Members.map((m) => redfish.get(m["@odata.id"])));
  for (const slot of slots) {
    let form = box.querySelector(`[data-slot="${CSS.escape(slot.Id)}"]`);
    if (!form) {
      form = mediaForm(slot);
      box.append(form);
    }
    const state = slot.Inserted ? `${slot.Image} (${slot.ConnectedVia || "inserted"})` : "empty";
    form.querySelector(".media-state").textContent = `${slot.Name || slot.Id}: ${state}`;
    form.querySelector(".eject").disabled = !slot.Inserted;
  }
}

function mediaForm(slot) {
  const id = `media-${slot.Id}`;
  const form = element("form", null, { "data-slot": slot.Id, class: "media" });
  const state = element("p", "", { class: "media-state", "aria-live": "polite" });
  const label = element("label", `Image URL for ${slot.Id}`, { for: `${id}-image` });
  const input = element("input", null, { id: `${id}-image`, type: "url", placeholder: "https://…/image.iso",
    autocomplete: "off" });
  const insert = element("button", "Insert", { type: "submit", class: "insert" });
  const eject = element("button", "Eject", { type: "button", class: "eject" });
  const progress = element("progress", null, { max: "100", value: "0", class: "task-progress",
    "aria-label": `Progress of the ${slot.Id} insert` });
  progress.hidden = true;
  const message = element("p", "", { class: "message task-message", role: "status", "aria-live": "polite" });
  form.append(state, label, input, insert, eject, progress, message);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const actions = slot.Actions || {};
    message.classList.remove("error");
    message.textContent = "Inserting…";
    progress.hidden = false;
    progress.value = 0;
    try {
      const answer = await redfish.action(actions["#VirtualMedia.InsertMedia"].target,
        { Image: input.value, Inserted: true, WriteProtected: true });
      const task = await redfish.follow(answer.location, (t) => {
        progress.value = t.PercentComplete || 0;
        message.textContent = `${t.TaskState}: ${t.PercentComplete || 0}%`;
      });
      const said = (task.Messages || []).map((m) => m.Message).join(" ");
      message.textContent = `${task.TaskState}${said ? `: ${said}` : ""}`;
      message.classList.toggle("error", task.TaskState !== "Completed");
    } catch (e) {
      message.textContent = e.message;
      message.classList.add("error");
    }
    scheduleRefresh();
  });
  eject.addEventListener("click", async () => {
    message.classList.remove("error");
    progress.hidden = true;
    try {
      await redfish.action((slot.Actions || {})["#VirtualMedia.EjectMedia"].target, {});
      message.textContent = "Ejected.";
    } catch (e) {
      message.textContent = e.message;
      message.classList.add("error");
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
  const current = sb.SecureBootCurrentBoot === null ? "the machine is off" : sb.SecureBootCurrentBoot;
  $("secureboot-state").textContent = `This boot: ${current}. Mode: ${sb.SecureBootMode}.`;
  if (document.activeElement !== $("secureboot-enable")) {
    $("secureboot-enable").checked = Boolean(sb.SecureBootEnable);
  }
}

$("secureboot-form").addEventListener("submit", (event) => {
  event.preventDefault();
  attempt("secureboot-message", () => redfish.patch(system.SecureBoot["@odata.id"],
    { SecureBootEnable: $("secureboot-enable").checked }), "Secure boot is set for the next boot.");
});

// ---- inventory

async function members(link) {
  if (!link) {
    return [];
  }
  const collection = await redfish.get(link["@odata.id"]);
  return Promise.all((collection.Members || []).map((m) => redfish.get(m["@odata.id"])));
}

async function showInventory(doc) {
  const facts = [
    ["Model", `${doc.Manufacturer || ""} ${doc.Model || ""}`.trim()],
    ["Serial number", doc.SerialNumber],
    ["UUID", doc.UUID],
    ["Processors", doc.ProcessorSummary &&
      `${doc.ProcessorSummary.Count} socket(s), ${doc.ProcessorSummary.LogicalProcessorCount} logical`],
    ["Memory", doc.MemorySummary && `${doc.MemorySummary.TotalSystemMemoryGiB} GiB`],
  ];
  const [nics, storages] = await Promise.all([members(doc.EthernetInterfaces), members(doc.Storage)]);
  for (const nic of nics) {
    facts.push([`Network ${nic.Id}`, `${nic.MACAddress || "no MAC yet"} (${nic.LinkStatus || ""})`]);
  }
  for (const storage of storages) {
    const drives = await Promise.all((storage.Drives || []).map((d) => redfish.get(d["@odata.id"])));
    for (const drive of drives) {
      const size = drive.CapacityBytes ? `${(drive.CapacityBytes / 2 ** 30).toFixed(1)} GiB` : "size unknown";
      facts.push([`Disk ${drive.Id}`, `${drive.MediaType || "disk"}, ${size}`]);
    }
  }
  $("inventory").replaceChildren(...facts.filter(([, v]) => v).flatMap(([k, v]) => [element("dt", k),
    element("dd", v)]));
}

// ---- events: the SSE stream, and the log services the BMC has

function addEvent(time, severity, message, origin) {
  const row = element("tr");
  row.append(element("td", time), element("td", severity), element("td", origin ? `${message} (${origin})` :
    message));
  const body = $("events").tBodies[0];
  body.prepend(row);
  while (body.rows.length > 200) {
    body.deleteRow(-1);
  }
}

async function follow() {
  const controller = new AbortController();
  streaming = controller;
  while (streaming === controller) {
    try {
      say("events-status", "Following the BMC's events (EventService, server-sent events).");
      await redfish.events((event) => {
        for (const record of event.Events || []) {
          const origin = record.OriginOfCondition && record.OriginOfCondition["@odata.id"];
          addEvent(record.EventTimestamp, record.MessageSeverity || record.Severity, record.Message, origin);
        }
        scheduleRefresh();
      }, controller.signal);
    } catch (e) {
      if (streaming !== controller) {
        return;
      }
      say("events-status", `The event stream stopped (${e.message}); following again…`, true);
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function loadLog() {
  // A LogService (a BMC's event log or SEL), where the BMC has one, on the System or the Manager.
  try {
    const managers = await redfish.get("/redfish/v1/Managers");
    const manager = await redfish.get(managers.Members[0]["@odata.id"]);
    const services = [...await members(system.LogServices), ...await members(manager.LogServices)];
    for (const service of services) {
      const entries = await members(service.Entries);
      for (const entry of entries.reverse()) {
        addEvent(entry.Created, entry.Severity, entry.Message, service.Name || service.Id);
      }
    }
  } catch (e) {
    // none: the live events are what there is
  }
}

// ---- the consoles' buttons

$("ctrl-alt-del").addEventListener("click", () => screen.ctrlAltDel());
$("screenshot").addEventListener("click", () => screen.screenshot($("screenshot-link")));

// For the tests and for people at the browser's console: the page's state, read-only.
window.kubevbmc = {
  get serial() { return serial.state; },
  get screen() { return screen.state; },
  get loggedIn() { return Boolean(redfish.token); },
  serialText() { return serial.text(); },
};

$("username").focus();
