// The console's only way to its data: the /v1 API, with the key from sessionStorage in a header. The key
// never goes in a URL: WebSockets (which cannot carry headers from a browser) offer it as a subprotocol.

const KEY = "space.console.key";
const PROJECT = "space.console.project";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const session = {
  key: () => sessionStorage.getItem(KEY),
  project: () => sessionStorage.getItem(PROJECT) || "",
  me: null, // GET /v1/whoami of this key
  save(key, project) {
    sessionStorage.setItem(KEY, key);
    if (project) sessionStorage.setItem(PROJECT, project); else sessionStorage.removeItem(PROJECT);
  },
  clear() {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(PROJECT);
    session.me = null;
  },
  canAct: () => session.me !== null && session.me.role !== "read-only",
};

function headers(extra = {}) {
  const found = { Authorization: `Bearer ${session.key()}`, ...extra };
  if (session.project()) found["X-Space-Project"] = session.project();
  return found;
}

function url(path, query) {
  const u = new URL(`/v1${path}`, location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    for (const each of Array.isArray(value) ? value : [value]) u.searchParams.append(name, each);
  }
  return u;
}

async function failure(response) {
  let code = "unknown", message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) ({ code, message } = body.error);
  } catch (_) { /* not JSON */ }
  if (response.status === 401) window.dispatchEvent(new CustomEvent("space:unauthenticated"));
  return new ApiError(response.status, code, message);
}

// JSON in, JSON out (or the Response itself with raw: true).
export async function api(method, path, { body, query, raw = false, contentType } = {}) {
  const init = { method, headers: headers(), cache: "no-store" };
  if (body !== undefined) {
    if (contentType) {
      init.headers["Content-Type"] = contentType;
      init.body = body;
    } else {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
  }
  const response = await fetch(url(path, query), init);
  if (!response.ok) throw await failure(response);
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

// Server-Sent Events read with fetch (EventSource cannot send headers): calls onEvent(kind, data) until
// the stream ends or `signal` aborts; resolves then, rejects with an ApiError on a refused request.
export async function events(path, onEvent, signal) {
  const response = await fetch(url(path), { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let kind = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) onEvent(kind, JSON.parse(data));
    }
  }
}

function base64url(text) {
  const raw = String.fromCharCode(...new TextEncoder().encode(text));
  return btoa(raw).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

export function ptySocket(sandboxId, rows, cols) {
  const u = url(`/sandboxes/${encodeURIComponent(sandboxId)}/pty`, { rows, cols });
  u.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(u, ["space-pty", `space-key.${base64url(session.key())}`]);
  socket.binaryType = "arraybuffer";
  return socket;
}

// A file of the sandbox, downloaded through the API and handed to the browser as a blob.
export async function download(sandboxId, path) {
  const response = await api("GET", `/sandboxes/${encodeURIComponent(sandboxId)}/files`, {
    query: { path }, raw: true,
  });
  const blob = await response.blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = path.split("/").pop() || "download";
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}
