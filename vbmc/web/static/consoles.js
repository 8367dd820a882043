// The BMC's consoles in the page: the serial line in a terminal (xterm.js) and the screen in a VNC client (noVNC),
// each over the BMC's WebSocket (vbmc/web/consoles.py): binary messages are the console's bytes, text messages say
// whether the console is attached, and the Redfish session token goes in the subprotocol list, never in the URL.

import { Terminal } from "/ui/vendor/xterm/xterm.mjs";
import { FitAddon } from "/ui/vendor/xterm-addon-fit/addon-fit.mjs";
import RFB from "/ui/vendor/novnc/core/rfb.js";

const TOKEN = "x-auth-token.";

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

function closedText(event, what) {
  const why = event.reason ? `: ${event.reason}` : "";
  return `The ${what} connection closed (${event.code}${why}).`;
}

export class SerialConsole {
  constructor(element, statusElement) {
    this.element = element;
    this.status = statusElement;
    this.socket = null;
    this.terminal = null;
    this.state = "closed";
  }

  open(uri, token) {
    this.close();
    if (!this.terminal) {
      this.terminal = new Terminal({ rows: 24, cols: 80, cursorBlink: true, scrollback: 2000,
        fontFamily: "ui-monospace, 'DejaVu Sans Mono', monospace", fontSize: 14, screenReaderMode: false });
      this.fit = new FitAddon();
      this.terminal.loadAddon(this.fit);
      this.terminal.open(this.element);
      this.terminal.onData((data) => this.type(data));
      window.addEventListener("resize", () => this.fit.fit());
    }
    this.fit.fit();
    const socket = new WebSocket(socketUrl(uri), ["kubevbmc", TOKEN + token]);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    this.state = "connecting";
    this.status.textContent = "Connecting to the serial console…";
    socket.onmessage = (event) => {
      if (typeof event.data === "string") {
        const status = JSON.parse(event.data);
        this.state = status.Attached ? "attached" : "detached";
        this.status.textContent = describe(status, "serial console");
      } else {
        this.terminal.write(new Uint8Array(event.data));
      }
    };
    socket.onclose = (event) => {
      if (this.socket === socket) {
        this.state = "closed";
        this.status.textContent = closedText(event, "serial console");
        this.socket = null;
      }
    };
  }

  // What the terminal holds, scrollback included, one line per row (xterm.js draws only what is on screen).
  text() {
    if (!this.terminal) {
      return "";
    }
    const buffer = this.terminal.buffer.active;
    const lines = [];
    for (let i = 0; i < buffer.length; i++) {
      lines.push(buffer.getLine(i).translateToString(true));
    }
    return lines.join("\n").replace(/\n+$/, "");
  }

  type(data) {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(new TextEncoder().encode(data));
    }
  }

  close() {
    if (this.socket) {
      this.socket.close(1000, "logged out");
    }
  }
}

// noVNC reads a WebSocket-like channel; this one passes it the binary messages (RFB) and keeps the text ones (the
// console's state) for the page.
class ScreenChannel {
  constructor(url, protocols, onStatus) {
    this.socket = new WebSocket(url, protocols);
    this.socket.binaryType = "arraybuffer";
    this.onopen = null;
    this.onmessage = null;
    this.onclose = null;
    this.onerror = null;
    this.socket.onopen = (e) => this.onopen && this.onopen(e);
    this.socket.onerror = (e) => this.onerror && this.onerror(e);
    this.socket.onclose = (e) => this.onclose && this.onclose(e);
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

export class Screen {
  constructor(element, statusElement) {
    this.element = element;
    this.status = statusElement;
    this.rfb = null;
    this.state = "closed";
  }

  open(uri, token) {
    this.close();
    this.state = "connecting";
    this.status.textContent = "Connecting to the screen…";
    const channel = new ScreenChannel(socketUrl(uri), ["binary", TOKEN + token], (status) => {
      this.state = status.Attached ? "attached" : "detached";
      this.status.textContent = describe(status, "screen");
    });
    const rfb = new RFB(this.element, channel, { shared: true });
    rfb.scaleViewport = true;
    rfb.background = "#000";
    rfb.addEventListener("disconnect", (event) => {
      if (this.rfb === rfb) {
        this.state = "closed";
        this.status.textContent = event.detail.clean ? "The screen connection closed." :
          "The screen connection was lost.";
        this.rfb = null;
      }
    });
    this.rfb = rfb;
  }

  ctrlAltDel() {
    if (this.rfb) {
      this.rfb.sendCtrlAltDel();
      this.rfb.focus();
    }
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

  close() {
    if (this.rfb) {
      this.rfb.disconnect();
    }
  }
}
