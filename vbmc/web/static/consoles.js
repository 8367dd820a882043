// The BMC's consoles in the page: the serial line in a terminal (xterm.js) and the screen in a VNC client (noVNC),
// each over the BMC's WebSocket (vbmc/web/consoles.py): binary messages are the console's bytes, text messages say
// whether the console is attached, and the Redfish session token goes in the subprotocol list, never in the URL.
//
// A console the BMC drops comes back by itself: at once after a network hiccup, later when the BMC said to try again
// (1013: every viewer slot taken), never when the session ended (1008: the page logs out). Each console's objects are
// made when a session starts and disposed of when it ends, so nothing of one session's console is left for the next.

import { Terminal } from "/ui/vendor/xterm/xterm.mjs";
import { FitAddon } from "/ui/vendor/xterm-addon-fit/addon-fit.mjs";
import RFB from "/ui/vendor/novnc/core/rfb.js";

const TOKEN = "x-auth-token.";
const SESSION_ENDED = 1008;
const TRY_AGAIN_LATER = 1013;
const RETRY_DELAYS = [1, 2, 4, 8, 15]; // seconds between attempts to reconnect a dropped console
const BUSY_RETRY = 10; // seconds, after "every viewer slot is taken"
const SERIAL_MESSAGE = 1024; // bytes per message typed on the serial line (the BMC takes up to 4 KiB)

function socketUrl(path) {
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${window.location.host}${path}`;
}

function describe(status, what) {
  if (status.Attached) {
    return `Connected to the ${what}.`;
  }
  if (status.Message === "connecting") {
    return `Connecting to the ${what}…`;
  }
  return `The ${what} is not available: ${status.Message}. It comes back by itself when the machine runs.`;
}

// Reconnects a console after a drop, with a growing delay; `connect()` opens it again.
class Redial {
  constructor(what, status, connect, onSessionEnded, onDropped) {
    this.what = what;
    this.status = status;
    this.connect = connect;
    this.onSessionEnded = onSessionEnded;
    this.onDropped = onDropped;
    this.failures = 0;
    this.timer = null;
    this.stopped = false;
  }

  attached() {
    this.failures = 0;
  }

  // The connection closed without the page asking: say why, and try again when it makes sense.
  closed(code, reason) {
    if (this.stopped) {
      return;
    }
    const why = reason ? `: ${reason}` : "";
    if (code === SESSION_ENDED) {
      this.status.textContent = `The ${this.what} closed${why}.`;
      this.onSessionEnded(reason || "the session ended");
      return;
    }
    const wait = code === TRY_AGAIN_LATER ? BUSY_RETRY
      : RETRY_DELAYS[Math.min(this.failures, RETRY_DELAYS.length - 1)];
    this.failures += 1;
    this.status.textContent = `The ${this.what} connection closed (${code}${why}). Trying again in ${wait} s…`;
    this.onDropped();
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      if (!this.stopped) {
        this.connect();
      }
    }, wait * 1000);
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
  }
}

export class SerialConsole {
  // `onSessionEnded(reason)`: the BMC ended the session; `onDropped()`: the connection dropped (the page checks the
  // session).
  constructor(element, statusElement, uri, token, { onSessionEnded, onDropped }) {
    this.element = element;
    this.status = statusElement;
    this.uri = uri;
    this.token = token;
    this.socket = null;
    this.state = "closed";
    this.terminal = new Terminal({ rows: 24, cols: 80, cursorBlink: true, scrollback: 2000,
      fontFamily: "ui-monospace, 'DejaVu Sans Mono', monospace", fontSize: 14, screenReaderMode: false });
    this.fit = new FitAddon();
    this.terminal.loadAddon(this.fit);
    this.terminal.open(this.element);
    // Tab leaves the terminal (the keyboard can always get out); Ctrl-I types the same character on the line.
    this.terminal.attachCustomKeyEventHandler((e) => !(e.key === "Tab" && !e.ctrlKey && !e.altKey && !e.metaKey));
    this.terminal.onData((data) => this.type(data));
    this.onResize = () => this.fit.fit();
    window.addEventListener("resize", this.onResize);
    this.redial = new Redial("serial console", this.status, () => this.connect(), onSessionEnded, onDropped);
    this.connect();
  }

  connect() {
    this.fit.fit();
    const socket = new WebSocket(socketUrl(this.uri), ["kubevbmc", TOKEN + this.token]);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    this.state = "connecting";
    this.status.textContent = "Connecting to the serial console…";
    socket.onmessage = (event) => {
      if (this.socket !== socket) {
        return;
      }
      if (typeof event.data === "string") {
        const status = JSON.parse(event.data);
        this.state = status.Attached ? "attached" : "detached";
        this.status.textContent = describe(status, "serial console");
        this.redial.attached();
      } else {
        this.terminal.write(new Uint8Array(event.data));
      }
    };
    socket.onclose = (event) => {
      if (this.socket === socket) {
        this.state = "closed";
        this.socket = null;
        this.redial.closed(event.code, event.reason);
      }
    };
  }

  // What the terminal holds, scrollback included, one line per row (xterm.js draws only what is on screen).
  text() {
    const buffer = this.terminal.buffer.active;
    const lines = [];
    for (let i = 0; i < buffer.length; i++) {
      lines.push(buffer.getLine(i).translateToString(true));
    }
    return lines.join("\n").replace(/\n+$/, "");
  }

  // What the operator types or pastes, in messages the BMC takes (it refuses one over 4 KiB with 1009).
  type(data) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) {
      return;
    }
    const bytes = new TextEncoder().encode(data);
    for (let at = 0; at < bytes.length; at += SERIAL_MESSAGE) {
      this.socket.send(bytes.subarray(at, at + SERIAL_MESSAGE));
    }
  }

  // The session is over: close the connection and drop the terminal with everything it showed.
  dispose() {
    this.redial.stop();
    window.removeEventListener("resize", this.onResize);
    const socket = this.socket;
    this.socket = null;
    this.state = "closed";
    if (socket) {
      socket.close(1000, "logged out");
    }
    this.terminal.dispose();
    this.element.replaceChildren();
  }
}

// noVNC reads a WebSocket-like channel; this one passes it the binary messages (RFB) and keeps the text ones (the
// console's state) for the page.
class ScreenChannel {
  constructor(url, protocols, onStatus, onClose) {
    this.socket = new WebSocket(url, protocols);
    this.socket.binaryType = "arraybuffer";
    this.onopen = null;
    this.onmessage = null;
    this.onclose = null;
    this.onerror = null;
    this.socket.onopen = (e) => this.onopen && this.onopen(e);
    this.socket.onerror = (e) => this.onerror && this.onerror(e);
    this.socket.onclose = (e) => {
      onClose(e);
      if (this.onclose) {
        this.onclose(e);
      }
    };
    this.socket.onmessage = (e) => {
      if (typeof e.data === "string") {
        onStatus(JSON.parse(e.data));
      } else if (this.onmessage) {
        this.onmessage(e);
      }
    };
  }

  get binaryType() { return this.socket.binaryType; }

  set binaryType(value) { this.socket.binaryType = value; }

  get protocol() { return this.socket.protocol; }

  get readyState() { return this.socket.readyState; }

  send(data) { this.socket.send(data); }

  close(code, reason) { this.socket.close(code, reason); }
}

// X keysyms and KeyboardEvent codes of the keys the page sends itself (noVNC passes both to QEMU).
const KEYS = {
  Control: [0xffe3, "ControlLeft"], Alt: [0xffe9, "AltLeft"], Shift: [0xffe1, "ShiftLeft"],
  Delete: [0xffff, "Delete"], Tab: [0xff09, "Tab"], Backspace: [0xff08, "Backspace"], Escape: [0xff1b, "Escape"],
  Enter: [0xff0d, "Enter"], F1: [0xffbe, "F1"], F2: [0xffbf, "F2"], F3: [0xffc0, "F3"], F7: [0xffc4, "F7"],
};
export const MACROS = {
  "ctrl-alt-del": ["Control", "Alt", "Delete"], "ctrl-alt-f1": ["Control", "Alt", "F1"],
  "ctrl-alt-f2": ["Control", "Alt", "F2"], "ctrl-alt-f3": ["Control", "Alt", "F3"],
  "ctrl-alt-f7": ["Control", "Alt", "F7"], "alt-tab": ["Alt", "Tab"],
  "ctrl-alt-backspace": ["Control", "Alt", "Backspace"], tab: ["Tab"], escape: ["Escape"],
};
const SHIFTED = "~!@#$%^&*()_+{}|:\"<>?";
const TYPE_LIMIT = 4096; // characters one "type this text" sends

export class Screen {
  constructor(element, statusElement, noSignal, uri, token, { onSessionEnded, onDropped }) {
    this.element = element;
    this.status = statusElement;
    this.noSignal = noSignal;
    this.uri = uri;
    this.token = token;
    this.rfb = null;
    this.state = "closed";
    this.typing = null;
    // Shift-Tab leaves the screen; every other key (Tab included) goes to the machine.
    this.onKey = (e) => {
      if (e.key === "Tab" && e.shiftKey) {
        e.stopPropagation();
      }
    };
    this.element.addEventListener("keydown", this.onKey, true);
    this.redial = new Redial("screen", this.status, () => this.connect(), onSessionEnded, onDropped);
    this.connect();
  }

  connect() {
    this.state = "connecting";
    this.status.textContent = "Connecting to the screen…";
    let rfb = null;
    const channel = new ScreenChannel(socketUrl(this.uri), ["binary", TOKEN + this.token], (status) => {
      if (this.rfb !== rfb) {
        return;
      }
      this.state = status.Attached ? "attached" : "detached";
      this.status.textContent = describe(status, "screen");
      this.noSignal.hidden = status.Attached;
      this.noSignal.textContent = status.Attached ? "" : `No signal: ${status.Message}`;
      this.redial.attached();
    }, (event) => {
      if (this.rfb === rfb) {
        this.state = "closed";
        this.rfb = null;
        this.noSignal.hidden = false;
        this.noSignal.textContent = "No signal";
        this.redial.closed(event.code, event.reason);
      }
    });
    rfb = new RFB(this.element, channel, { shared: true });
    rfb.scaleViewport = true;
    rfb.background = "#000";
    const canvas = this.element.querySelector("canvas");
    if (canvas) {
      canvas.tabIndex = 0; // reachable with Tab, not only by a click
      canvas.setAttribute("aria-label", "Screen of the machine");
    }
    this.rfb = rfb;
  }

  sendKeys(macro) {
    const keys = MACROS[macro];
    if (!this.rfb || !keys) {
      return false;
    }
    for (const key of keys) {
      this.rfb.sendKey(KEYS[key][0], KEYS[key][1], true);
    }
    for (const key of [...keys].reverse()) {
      this.rfb.sendKey(KEYS[key][0], KEYS[key][1], false);
    }
    return true;
  }

  // Type `text` as keystrokes (what "paste" is on a KVM: the machine has no clipboard of ours), a few keys at a
  // time so that a slow guest keeps up. Resolves to the number of characters sent.
  async type(text) {
    if (!this.rfb) {
      return 0;
    }
    const token = {};
    this.typing = token;
    const chars = [...text.slice(0, TYPE_LIMIT)];
    let sent = 0;
    for (const ch of chars) {
      if (this.typing !== token || !this.rfb) {
        break;
      }
      const code = ch.codePointAt(0);
      const keysym = ch === "\n" ? KEYS.Enter[0] : ch === "\t" ? KEYS.Tab[0] : code < 0x100 ? code
        : 0x01000000 + code;
      const shift = /[A-Z]/.test(ch) || SHIFTED.includes(ch);
      if (shift) {
        this.rfb.sendKey(KEYS.Shift[0], KEYS.Shift[1], true);
      }
      this.rfb.sendKey(keysym, null, true);
      this.rfb.sendKey(keysym, null, false);
      if (shift) {
        this.rfb.sendKey(KEYS.Shift[0], KEYS.Shift[1], false);
      }
      sent += 1;
      if (sent % 8 === 0) {
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    }
    return sent;
  }

  fullscreen(frame) {
    if (document.fullscreenElement) {
      return document.exitFullscreen();
    }
    return frame.requestFullscreen().then(() => {
      const canvas = this.element.querySelector("canvas");
      if (canvas) {
        canvas.focus();
      }
    });
  }

  screenshot(link) {
    if (!this.rfb) {
      return false;
    }
    link.href = this.rfb.toDataURL("image/png");
    link.download = `screen-${new Date().toISOString().replace(/[:.]/g, "-")}.png`;
    link.click();
    return true;
  }

  dispose() {
    this.redial.stop();
    this.typing = null;
    this.element.removeEventListener("keydown", this.onKey, true);
    const rfb = this.rfb;
    this.rfb = null;
    this.state = "closed";
    if (rfb) {
      rfb.disconnect();
    }
    this.element.replaceChildren();
  }
}
