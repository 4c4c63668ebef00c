// Credentials: names, hosts, how they are injected, when they expire and how much the gateways used them
// (the usage the list carries: injections and refusals from the audit log, never a value).
import { api } from "./api.js";
import { h, replace, when } from "./dom.js";

function count(n, noun) {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

function usage(u) {
  if (!u) return "–";
  const used = u.injected ? [count(u.injected, "injection"), h("span", { class: "legend" }, ` (last ${when(u.last_used_at)})`)]
    : "not used";
  const refused = u.refused ? [h("br"), h("span", { class: "error" }, count(u.refused, "refusal")),
    h("span", { class: "legend" }, ` (last ${when(u.last_refused_at)})`)] : "";
  return [used, refused];
}

export function credentialsPage(main) {
  const body = h("div", {}, "Loading…");
  replace(main, h("h1", {}, "Credentials"),
    h("p", { class: "legend" }, "Values are never shown: SPACE keeps them out of every sandbox and every answer. " +
      "Usage counts what the gateways reported while the audit log keeps it (values put into requests, " +
      "requests refused)."),
    body);
  api("GET", "/credentials").then(({ credentials }) => {
    replace(body, h("table", { "aria-label": "Credentials" },
      h("thead", {}, h("tr", {}, ["Name", "Scope", "Hosts", "Method", "Env variable", "Expires", "Rate / min", "Usage", "Updated"]
        .map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, credentials.length ? credentials.map((c) => h("tr", {},
        h("td", { class: "mono", "data-label": "Name" }, c.name),
        h("td", { "data-label": "Scope" }, c.scope === "sandbox" ? `sandbox ${c.sandbox_id}` : c.scope),
        h("td", { class: "mono", "data-label": "Hosts" }, c.hosts.join(", ")),
        h("td", { "data-label": "Method" }, c.method),
        h("td", { class: "mono", "data-label": "Env variable" }, c.env_var || "–"),
        h("td", { "data-label": "Expires" }, c.expires_at
          ? [when(c.expires_at), c.expired ? h("span", { class: "badge failed" }, "expired") : ""] : "never"),
        h("td", { "data-label": "Rate / min" }, c.rate_per_minute ?? "–"),
        h("td", { "data-label": "Usage", "data-usage": c.usage ? c.usage.injected : "" }, usage(c.usage)),
        h("td", { "data-label": "Updated" }, when(c.updated_at))))
        : h("tr", {}, h("td", { colspan: 9, class: "empty" }, "No credentials.")))));
  }).catch((exc) => replace(body, h("p", { class: "panel" }, exc.message)));
  return null;
}
