// A sandbox's family drawn as a tree: from its oldest known ancestor down, each sandbox's snapshots in
// time order (and its rollbacks, where its events tell of them), and every fork as a branch under the
// snapshot it started from (`fork_snapshot_id`), or under its source when that snapshot is not listed.
import { api } from "./api.js";
import { h, when, bytes } from "./dom.js";
import { live } from "./live.js";

const MAX_FAMILY = 64;

async function sandbox(id) {
  if (live.sandboxes.has(id)) return live.sandboxes.get(id);
  try { return await api("GET", `/sandboxes/${encodeURIComponent(id)}`); } catch (_) { return null; }
}

async function snapshotsOf(id) {
  try { return (await api("GET", `/sandboxes/${encodeURIComponent(id)}/snapshots`)).snapshots; }
  catch (_) { return []; }
}

async function rollbacksOf(id) {
  try {
    const { events } = await api("GET", `/sandboxes/${encodeURIComponent(id)}/events`, { query: { limit: 500 } });
    return events.filter((e) => e.kind.includes("roll") && e.detail && e.detail.snapshot_id);
  } catch (_) { return []; }
}

function children(id) {
  return [...live.sandboxes.values()].filter((sb) => sb.forked_from === id);
}

export async function drawTree(currentId) {
  // Up to the oldest ancestor this key can still see.
  let root = await sandbox(currentId);
  let rootId = currentId;
  const chain = new Set([currentId]);
  while (root && root.forked_from && !chain.has(root.forked_from) && chain.size < MAX_FAMILY) {
    chain.add(root.forked_from);
    const parent = await sandbox(root.forked_from);
    rootId = root.forked_from;
    if (!parent) { root = null; break; }
    root = parent;
  }
  let budget = MAX_FAMILY;
  async function branch(id, sb) {
    budget -= 1;
    const label = h("span", { class: `node sandbox${id === currentId ? " current" : ""}`, "data-sandbox": id },
      h("a", { href: `#/sandboxes/${id}`, class: "mono" }, id),
      sb ? h("span", { class: "badge" }, sb.state) : h("span", { class: "badge" }, "deleted"),
      sb ? h("span", {}, when(sb.created_at)) : "");
    const [snaps, rollbacks] = sb ? await Promise.all([snapshotsOf(id), rollbacksOf(id)]) : [[], []];
    const kids = budget > 0 ? children(id) : [];
    const items = [
      ...snaps.map((s) => ({ at: s.created_at, kind: "snapshot", s })),
      ...rollbacks.map((e) => ({ at: e.at, kind: "rollback", e })),
    ].sort((a, b) => a.at.localeCompare(b.at));
    const known = new Set(snaps.map((s) => s.id));
    const list = [];
    for (const item of items) {
      if (item.kind === "rollback") {
        list.push(h("li", {}, h("span", { class: "node rollback" }, "rolled back to ",
          h("span", { class: "mono" }, item.e.detail.snapshot_id), h("span", {}, when(item.at)))));
        continue;
      }
      const s = item.s;
      const forks = [];
      for (const kid of kids.filter((k) => k.fork_snapshot_id === s.id)) forks.push(await branch(kid.id, kid));
      list.push(h("li", { "data-snapshot": s.id },
        h("span", { class: "node" }, h("span", { class: "mono" }, s.name || s.id),
          h("span", { class: "badge" }, s.kind), h("span", {}, when(s.created_at)),
          h("span", {}, bytes(s.size_bytes))),
        forks.length ? h("ul", {}, forks) : ""));
    }
    for (const kid of kids.filter((k) => !known.has(k.fork_snapshot_id))) list.push(await branch(kid.id, kid));
    return h("li", { class: id === rootId ? "" : "branch" }, label, list.length ? h("ul", {}, list) : "");
  }
  return h("div", { class: "tree" },
    h("ul", {}, await branch(rootId, root)));
}
