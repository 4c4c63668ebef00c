// Credentials: names, hosts, how they are injected and when they expire. The API never returns a value.
import { api } from "./api.js";
import { h, replace, when } from "./dom.js";

export function credentialsPage(main) {
  const body = h("div", {}, "Loading…");
  replace(main, h("h1", {}, "Credentials"),
    h("p", { class: "legend" }, "Values are never shown: SPACE keeps them out of every sandbox and every answer."),
    body);
  api("GET", "/credentials").then(({ credentials }) => {
    replace(body, h("table", { "aria-label": "Credentials" },
      h("thead", {}, h("tr", {}, ["Name", "Scope", "Hosts", "Method", "Env variable", "Expires", "Rate / min", "Updated"]
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
        h("td", { "data-label": "Updated" }, when(c.updated_at))))
        : h("tr", {}, h("td", { colspan: 8, class: "empty" }, "No credentials.")))));
  }).catch((exc) => replace(body, h("p", { class: "panel" }, exc.message)));
  return null;
}
