// The project's sandboxes, kept current by GET /v1/sandbox-updates (Server-Sent Events): one stream for
// the whole console, re-opened after a drop; pages subscribe to be told when anything changed.
import { events } from "./api.js";

const listeners = new Set();
let controller = null;
let retry = null;

export const live = {
  sandboxes: new Map(),
  connected: false,
  start() {
    if (controller) return;
    controller = new AbortController();
    const mine = controller;
    events("/sandbox-updates", (kind, data) => {
      if (kind === "snapshot") {
        live.sandboxes = new Map(data.sandboxes.map((sb) => [sb.id, sb]));
      } else if (kind === "sandbox") {
        live.sandboxes.set(data.id, data);
      } else if (kind === "removed") {
        live.sandboxes.delete(data.id);
      }
      live.connected = true;
      notify();
    }, mine.signal).catch(() => {}).finally(() => {
      live.connected = false;
      if (controller !== mine) return;
      controller = null;
      notify();
      retry = setTimeout(() => live.start(), 2000); // dropped: open it again
    });
  },
  stop() {
    clearTimeout(retry);
    if (controller) { const old = controller; controller = null; old.abort(); }
    live.sandboxes = new Map();
  },
  // Put what an action answered in at once (the stream will confirm it).
  put(sb) { live.sandboxes.set(sb.id, sb); notify(); },
  subscribe(fn) { listeners.add(fn); fn(); return () => listeners.delete(fn); },
};

function notify() { for (const fn of listeners) fn(); }
