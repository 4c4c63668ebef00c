// The sandboxes page: the project's sandboxes, live, with filters, actions and a create dialog.
import { api, session } from "./api.js";
import { field, h, replace, say, when, confirmAction } from "./dom.js";
import { live } from "./live.js";

const STATES = ["pending", "creating", "running", "pausing", "paused", "resuming", "suspending",
  "suspended", "restoring", "stopping", "stopped", "starting", "checkpointing", "rolling_back",
  "crashed", "recovering", "failed", "deleting"];

// Which actions a state allows (the lifecycle table's requests; the API has the last word).
const ACTIONS = [
  { name: "pause", label: "Pause", states: ["running"] },
  { name: "resume", label: "Resume", states: ["paused", "suspended"] },
  { name: "snapshot", label: "Snapshot", states: ["running"] },
  { name: "fork", label: "Fork", states: ["running", "paused"] },
  { name: "suspend", label: "Suspend", states: ["running", "paused"], confirm: true },
  { name: "delete", label: "Delete", states: null, confirm: true },
];

export function badge(sb) {
  const busy = sb.state.endsWith("ing") || sb.state === "pending";
  const cls = busy ? "busy" : sb.state;
  const text = sb.state === sb.desired_state || busy ? sb.state : `${sb.state} → ${sb.desired_state}`;
  return h("span", { class: `badge ${cls}`, "data-state": sb.state }, text);
}

// Ask for it (confirmed first when destructive): true once the API accepted it.
export async function act(sb, name) {
  const id = encodeURIComponent(sb.id);
  if (name === "delete" && !(await confirmAction(`Delete ${sb.id}?`,
    "The sandbox, its disk and its snapshots on the node are removed. This cannot be undone.", "Delete"))) {
    return false;
  }
  if (name === "suspend" && !(await confirmAction(`Suspend ${sb.id}?`,
    "Its processes stop running until it is resumed; its memory and disk go to object storage.", "Suspend"))) {
    return false;
  }
  try {
    if (name === "delete") {
      live.put(await api("DELETE", `/sandboxes/${id}`));
    } else if (name === "snapshot") {
      const snap = await api("POST", `/sandboxes/${id}/snapshots`, { body: { full: true } });
      say(`Snapshot ${snap.id} taken`);
    } else if (name === "fork") {
      const { sandboxes } = await api("POST", `/sandboxes/${id}/fork`, { body: { count: 1 } });
      for (const child of sandboxes) live.put(child);
      say(`Forked into ${sandboxes.map((c) => c.id).join(", ")}`);
    } else {
      const verb = name === "resume" && sb.state === "suspended" ? "restore" : name;
      live.put(await api("POST", `/sandboxes/${id}/${verb}`, { query: { wait: "false" } }));
    }
  } catch (exc) {
    say(`${name} refused: ${exc.message}`, true);
    return false;
  }
  return true;
}

export function actionButtons(sb, { onDone } = {}) {
  return ACTIONS.map((a) => {
    const allowed = sb.state !== "deleted" && (a.states === null || a.states.includes(sb.state));
    const disabled = !session.canAct() || !allowed;
    return h("button", {
      type: "button", class: `small${a.name === "delete" ? " danger" : ""}`, disabled,
      "data-action": a.name, "aria-label": `${a.label} ${sb.id}`,
      title: session.canAct() ? "" : "a read-only key cannot do this",
      onclick: async () => { if ((await act(sb, a.name)) && onDone) onDone(a.name); },
    }, a.label);
  });
}

function matches(sb, filter) {
  if (filter.state && sb.state !== filter.state) return false;
  if (filter.template && !sb.template.includes(filter.template)) return false;
  if (filter.metadata) {
    const text = Object.entries(sb.metadata || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    if (!text.toLowerCase().includes(filter.metadata.toLowerCase())) return false;
  }
  return true;
}

function row(sb) {
  const meta = Object.entries(sb.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  return h("tr", { "data-id": sb.id },
    h("td", { class: "mono", "data-label": "Sandbox" }, h("a", { href: `#/sandboxes/${sb.id}` }, sb.id)),
    h("td", { "data-label": "State" }, badge(sb)),
    h("td", { "data-label": "Template" }, sb.template),
    h("td", { "data-label": "Metadata", class: "mono" }, meta),
    h("td", { "data-label": "Created" }, when(sb.created_at)),
    h("td", { class: "actions", "data-label": "Actions" }, actionButtons(sb)));
}

async function createDialog() {
  const templates = (await api("GET", "/templates")).templates.filter((t) => t.status === "ready");
  const select = h("select", { id: "create-template", name: "template" },
    templates.map((t) => h("option", { value: t.name }, t.name)));
  const metadata = h("input", { id: "create-metadata", placeholder: "team=ml, owner=me" });
  const error = h("p", { class: "error", role: "alert" });
  const dialog = h("dialog", { "aria-labelledby": "create-title" },
    h("form", { class: "fields", method: "dialog" },
      h("h2", { id: "create-title" }, "Create a sandbox"),
      field("Template", select),
      field("Metadata (key=value, comma separated)", metadata),
      error,
      h("div", { class: "buttons" },
        h("button", { value: "cancel", formnovalidate: true }, "Cancel"),
        h("button", { value: "create", class: "primary", id: "create-submit" }, "Create"))));
  document.body.append(dialog);
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue === "create") {
      const pairs = metadata.value.split(",").map((p) => p.trim()).filter(Boolean);
      const body = { template: select.value, wait: false,
        metadata: Object.fromEntries(pairs.map((p) => [p.split("=")[0].trim(), p.split("=").slice(1).join("=").trim()])) };
      try {
        const sb = await api("POST", "/sandboxes", { body });
        live.put(sb);
        say(`Creating ${sb.id}`);
      } catch (exc) {
        say(`create refused: ${exc.message}`, true);
      }
    }
    dialog.remove();
  });
  dialog.showModal();
  select.focus();
}

export function sandboxesPage(main) {
  const filter = { state: "", template: "", metadata: "" };
  const body = h("tbody");
  const count = h("span", { class: "legend", "aria-live": "polite" });
  const state = h("select", { id: "filter-state" }, h("option", { value: "" }, "any"),
    STATES.map((s) => h("option", { value: s }, s)));
  const template = h("input", { id: "filter-template", type: "search" });
  const metadata = h("input", { id: "filter-metadata", type: "search", placeholder: "key=value" });
  for (const [el, name] of [[state, "state"], [template, "template"], [metadata, "metadata"]]) {
    el.addEventListener("input", () => { filter[name] = el.value.trim(); render(); });
  }
  const create = h("button", { type: "button", class: "primary", id: "create", disabled: !session.canAct(),
    title: session.canAct() ? "" : "a read-only key cannot create sandboxes", onclick: () => createDialog() },
    "Create sandbox");

  // Rows are kept while their sandbox is unchanged, so a live update does not take the keyboard focus
  // away from a row it did not touch.
  const rows = new Map();
  function rowFor(sb) {
    const have = rows.get(sb.id);
    if (have && have[0] === sb) return have[1];
    const tr = row(sb);
    rows.set(sb.id, [sb, tr]);
    return tr;
  }

  function render() {
    const all = [...live.sandboxes.values()].sort((a, b) => b.created_at.localeCompare(a.created_at));
    const shown = all.filter((sb) => matches(sb, filter));
    replace(count, live.connected ? `${shown.length} of ${all.length} · live` : "connecting…");
    const wanted = shown.length ? shown.map(rowFor)
      : [h("tr", {}, h("td", { colspan: 6, class: "empty" }, all.length ? "No sandbox matches." : "No sandboxes yet."))];
    wanted.forEach((tr, i) => { if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null); });
    while (body.children.length > wanted.length) body.lastElementChild.remove();
    for (const id of rows.keys()) if (!live.sandboxes.has(id)) rows.delete(id);
  }

  replace(main,
    h("h1", {}, "Sandboxes"),
    h("div", { class: "filters", role: "search", "aria-label": "Filter sandboxes" },
      field("Filter by state", state),
      field("Filter by template", template),
      field("Filter by metadata", metadata),
      count, h("span", { class: "spacer" }), create),
    h("table", { "aria-label": "Sandboxes" },
      h("thead", {}, h("tr", {}, ["Sandbox", "State", "Template", "Metadata", "Created", "Actions"]
        .map((t) => h("th", { scope: "col" }, t)))),
      body));
  return live.subscribe(render);
}
