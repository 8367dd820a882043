// A Redfish client of the BMC that serves this page: sessions, reads, PATCH with If-Match, actions, tasks and the
// EventService's SSE stream. The session token lives in this object only: never in localStorage, sessionStorage,
// a cookie or a URL (a reload logs out).

// The BMC's own words for a refusal: error.message (the registry's text and the BMC's detail, e.g. "a medium is
// already inserted: eject it first"); the ExtendedInfo messages when there are several (error.message then only
// points at them). GeneralError's own text names @Message.ExtendedInfo too: with one message, error.message it is.
export function errorText(status, body) {
  const info = body && body.error;
  const extended = (info && info["@Message.ExtendedInfo"]) || [];
  if (info && info.message && extended.length <= 1) {
    return info.message;
  }
  return extended.map((m) => m.Message).join(" ") || (info && info.message) || `HTTP ${status}`;
}

export class RedfishError extends Error {
  constructor(status, body) {
    super(errorText(status, body));
    this.status = status;
  }
}

export class Redfish {
  constructor() {
    this.token = "";
    this.session = "";
  }

  async login(username, password) {
    const resp = await fetch("/redfish/v1/SessionService/Sessions", {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-KubeVBMC-Client": "page" },
      body: JSON.stringify({ UserName: username, Password: password }),
      credentials: "omit",
      cache: "no-store",
    });
    const body = await resp.json().catch(() => null);
    if (resp.status !== 201) {
      throw new RedfishError(resp.status, body);
    }
    this.token = resp.headers.get("X-Auth-Token") || "";
    this.session = resp.headers.get("Location") || (body && body["@odata.id"]) || "";
    return body;
  }

  async logout() {
    const session = this.session;
    this.session = "";
    if (session && this.token) {
      await this.request("DELETE", session).catch(() => null);
    }
    this.token = "";
  }

  async request(method, path, body, extraHeaders) {
    const headers = { "X-Auth-Token": this.token, ...(extraHeaders || {}) };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
    }
    const resp = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
    });
    const text = await resp.text();
    let doc = null;
    if (text) {
      try {
        doc = JSON.parse(text);
      } catch (e) {
        doc = null;
      }
    }
    if (!resp.ok) {
      throw new RedfishError(resp.status, doc);
    }
    return { status: resp.status, doc, etag: resp.headers.get("ETag"), location: resp.headers.get("Location") };
  }

  async get(path) {
    return (await this.request("GET", path)).doc;
  }

  // PATCH a resource with the ETag of a fresh read (DSP0266: If-Match).
  async patch(path, body) {
    const current = await this.request("GET", path);
    const headers = current.etag ? { "If-Match": current.etag } : {};
    return (await this.request("PATCH", path, body, headers)).doc;
  }

  async action(target, body) {
    return this.request("POST", target, body || {});
  }

  // Follow a task until it ends; `progress` gets every state read.
  async follow(taskUri, progress, interval = 500, limit = 600) {
    for (let i = 0; i < limit; i++) {
      const task = await this.get(taskUri);
      progress(task);
      if (!["New", "Starting", "Running", "Pending", "Stopping", "Cancelling", "Suspended", "Service"]
        .includes(task.TaskState)) {
        return task;
      }
      await new Promise((resolve) => setTimeout(resolve, interval));
    }
    throw new Error("the task did not end");
  }

  // The EventService's SSE stream, read with fetch (EventSource cannot send the session header). `onEvent` gets
  // each Event document; the promise ends when the stream does or `signal` aborts it.
  async events(onEvent, signal) {
    const service = await this.get("/redfish/v1/EventService");
    const resp = await fetch(service.ServerSentEventUri, {
      headers: { "X-Auth-Token": this.token, Accept: "text/event-stream" },
      credentials: "omit",
      cache: "no-store",
      signal,
    });
    if (!resp.ok || !resp.body) {
      throw new RedfishError(resp.status, null);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        return;
      }
      buffered += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const block = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) {
          try {
            onEvent(JSON.parse(data));
          } catch (e) {
            // not JSON: nothing this page reads
          }
        }
      }
    }
  }
}
