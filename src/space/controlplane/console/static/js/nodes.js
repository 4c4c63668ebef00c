import { api } from "./api.js";
import { bytes, h, replace, when } from "./dom.js";

const MIB = 1024 * 1024;

// Capacity and use as people read them; keys this console does not know are shown as they are.
function amounts(obj) {
  const known = {
    cpus: (v) => `${v} CPU${v === 1 ? "" : "s"}`,
    memory_mb: (v) => `${bytes(v * MIB)} memory`,
    disk_mb: (v) => `${bytes(v * MIB)} disk`,
    disk_free_mb: (v) => `${bytes(v * MIB)} free`,
    disk_reserve_mb: (v) => `${bytes(v * MIB)} reserved`,
    sandboxes: (v) => `${v} sandbox${v === 1 ? "" : "es"}`,
  };
  const parts = Object.entries(obj || {}).filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => (known[k] ? known[k](v) : `${k}: ${v}`));
  return parts.length ? parts.map((p) => h("div", {}, p)) : "–";
}

function pools(obj) {
  if (obj === null || obj === undefined) return "not reported";
  const ready = Object.entries(obj).map(([t, n]) => `${t}: ${n} ready`);
  return ready.length ? ready.map((p) => h("div", {}, p)) : "none ready";
}

export function nodesPage(main) {
  const body = h("div", {}, "Loading…");
  replace(main, h("h1", {}, "Nodes"), body);
  api("GET", "/cluster/nodes").then(({ nodes }) => {
    replace(body, h("table", { "aria-label": "Nodes" },
      h("thead", {}, h("tr", {}, ["Node", "Status", "Capacity", "Used", "Warm pools", "Templates", "Last heartbeat"]
        .map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, nodes.length ? nodes.map((n) => h("tr", {},
        h("td", { class: "mono", "data-label": "Node" }, n.id),
        h("td", { "data-label": "Status" }, h("span", { class: `badge ${n.status === "ready" ? "running" : "failed"}` }, n.status)),
        h("td", { "data-label": "Capacity" }, amounts(n.capacity)),
        h("td", { "data-label": "Used" }, amounts(n.used)),
        h("td", { "data-label": "Warm pools" }, pools(n.pools)),
        h("td", { "data-label": "Templates" }, n.templates.join(", ") || "–"),
        h("td", { "data-label": "Last heartbeat" }, when(n.last_heartbeat_at))))
        : h("tr", {}, h("td", { colspan: 7, class: "empty" }, "No nodes registered.")))));
  }).catch((exc) => {
    replace(body, h("p", { class: "panel" }, exc.status === 403
      ? "Nodes are the operator's machines: only an organisation admin key can list them."
      : exc.message));
  });
  return null;
}
