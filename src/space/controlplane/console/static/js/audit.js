// What the sandbox's bound credentials did for it (injected, denied, rate limited, fetched by its node...):
// the credentials' audit logs, read with the user's key and kept to this sandbox's entries. Never a value.
import { api } from "./api.js";
import { h, when } from "./dom.js";

const SHOWN = 20;

async function entriesOf(credential, sandboxId) {
  const query = { scope: credential.scope, limit: 1000 };
  if (credential.scope === "sandbox") query.sandbox_id = credential.sandbox_id;
  const { entries } = await api("GET", `/credentials/${encodeURIComponent(credential.name)}/audit`, { query });
  return entries.filter((e) => e.sandbox_id === sandboxId);
}

export async function auditTable(sandboxId, bound) {
  if (!bound || !bound.length) return h("p", { class: "empty" }, "No credentials are bound to this sandbox.");
  const { credentials } = await api("GET", "/credentials");
  const mine = credentials.filter((c) => bound.includes(c.name)
    && (c.scope !== "sandbox" || c.sandbox_id === sandboxId));
  const found = (await Promise.all(mine.map((c) => entriesOf(c, sandboxId)))).flat()
    .sort((a, b) => b.at.localeCompare(a.at)).slice(0, SHOWN);
  if (!found.length) return h("p", { class: "empty" }, "Its credentials have not been used yet.");
  return h("table", { "aria-label": "Credential use" },
    h("thead", {}, h("tr", {}, ["When", "Credential", "What", "Host"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, found.map((e) => h("tr", {},
      h("td", { "data-label": "When" }, when(e.at)),
      h("td", { class: "mono", "data-label": "Credential" }, e.credential),
      h("td", { "data-label": "What" }, e.action),
      h("td", { class: "mono", "data-label": "Host" }, e.host || "–")))));
}
