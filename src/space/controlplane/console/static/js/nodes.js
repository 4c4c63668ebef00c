import { api } from "./api.js";
import { h, replace, when } from "./dom.js";

function pairs(obj) {
  return Object.entries(obj || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "–";
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
        h("td", { "data-label": "Capacity" }, pairs(n.capacity)),
        h("td", { "data-label": "Used" }, pairs(n.used)),
        h("td", { "data-label": "Warm pools" }, n.pools === null ? "not reported" : pairs(n.pools)),
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
