// A sandbox's family drawn as a tree, from its oldest known ancestor down. Each sandbox's history is a line
// of its snapshots in time order. A rollback (the `sandbox.rolled_back` events) starts a new line hung
// under the snapshot it went back to: what was taken after it continues there, while the abandoned line
// stays visible. Every fork is a branch under the snapshot it started from (`fork_snapshot_id`), or
// under its source when that snapshot is not listed. "now" marks where each sandbox currently is.
// Nesting lists (ul > li) carry the structure, so a screen reader announces the levels; every item says
// in words what it is (snapshot, rolled back, fork, now), never only by colour or indentation.
import { api, session } from "./api.js";
import { h, when, bytes, say, confirmAction } from "./dom.js";
import { live } from "./live.js";

const MAX_FAMILY = 64;
const MAX_EVENT_PAGES = 10; // 500 rollbacks per page: plenty for one sandbox's drawing
const ROLLBACK_STATES = ["running", "paused", "stopped", "crashed"]; // the lifecycle's rollback requests

async function sandbox(id) {
  if (live.sandboxes.has(id)) return live.sandboxes.get(id);
  try { return await api("GET", `/sandboxes/${encodeURIComponent(id)}`); } catch (_) { return null; }
}

async function snapshotsOf(id) {
  try { return (await api("GET", `/sandboxes/${encodeURIComponent(id)}/snapshots`)).snapshots; }
  catch (_) { return []; }
}

async function rollbacksOf(id) {
  const found = [];
  let after = 0;
  try {
    for (let page = 0; page < MAX_EVENT_PAGES; page++) {
      const answer = await api("GET", `/sandboxes/${encodeURIComponent(id)}/events`,
        { query: { kind: "sandbox.rolled_back", limit: 500, after } });
      found.push(...answer.events.filter((e) => e.detail && e.detail.snapshot_id));
      if (answer.next_after === null) break;
      after = answer.next_after;
    }
  } catch (_) { /* drawn without them */ }
  return found;
}

function children(id) {
  return [...live.sandboxes.values()].filter((sb) => sb.forked_from === id);
}

function snapshotLabel(s) {
  return s.name ? `${s.name} (${s.id})` : s.id;
}

function rolledTo(e) {
  return e.detail.snapshot_name ? `${e.detail.snapshot_name} (${e.detail.snapshot_id})` : e.detail.snapshot_id;
}

function rollbackButton(sb, s, onChange) {
  const allowed = session.canAct() && ROLLBACK_STATES.includes(sb.state) && s.state === "ready";
  return h("button", {
    type: "button", class: "small", "data-rollback": s.id, disabled: !allowed,
    "aria-label": `Roll back ${sb.id} to ${snapshotLabel(s)}`,
    title: session.canAct() ? "" : "a read-only key cannot do this",
    onclick: async () => {
      const memory = s.kind === "full" ? "its memory, processes and disk" : "its disk";
      if (!(await confirmAction(`Roll back ${sb.id} to ${snapshotLabel(s)}?`,
        `${memory[0].toUpperCase()}${memory.slice(1)} return to that snapshot; what changed since is lost ` +
        "(its later snapshots stay, on their own branch).", "Roll back"))) return;
      try {
        live.put(await api("POST", `/sandboxes/${encodeURIComponent(sb.id)}/rollback`,
          { body: { snapshot_id: s.id } }));
        say(`Rolled back to ${snapshotLabel(s)}`);
      } catch (exc) {
        say(`rollback refused: ${exc.message}`, true);
      }
      if (onChange) onChange();
    },
  }, "Roll back");
}

// One sandbox's history as lines: [{rollback: event|null, items: [{s, hung: [...]}], leftBy?}], the first line
// being its own from its start; each rollback line is also hung under its snapshot (or, that snapshot
// being gone, listed at the top). Returns [rootLine, orphanLines, currentLine].
function lines(snaps, rollbacks) {
  const steps = [
    ...snaps.map((s) => ({ at: s.created_at, s })),
    ...rollbacks.map((e) => ({ at: e.at, e })),
  ].sort((a, b) => a.at.localeCompare(b.at));
  const root = { rollback: null, items: [] };
  const orphans = [];
  const nodes = new Map();
  let current = root;
  for (const step of steps) {
    if (step.s) {
      const node = { s: step.s, hung: [] };
      nodes.set(step.s.id, node);
      current.items.push(node);
    } else {
      const line = { rollback: step.e, items: [] };
      const target = nodes.get(step.e.detail.snapshot_id);
      if (target) target.hung.push({ at: step.e.at, line }); else orphans.push(line);
      current.leftBy = step.e; // a line is left once: a rollback always starts a new one
      current = line;
    }
  }
  return [root, orphans, current];
}

export async function drawTree(currentId, { onChange } = {}) {
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
      h("span", { class: "kind" }, id === rootId ? "sandbox" : "fork"),
      h("a", { href: `#/sandboxes/${id}`, class: "mono" }, id),
      sb ? h("span", { class: "badge" }, sb.state) : h("span", { class: "badge" }, "deleted"),
      sb ? h("span", { class: "when" }, when(sb.created_at)) : "");
    const [snaps, rollbacks] = sb ? await Promise.all([snapshotsOf(id), rollbacksOf(id)]) : [[], []];
    const kids = budget > 0 ? children(id) : [];
    const [own, orphans, current] = lines(snaps, rollbacks);
    const known = new Set(snaps.map((s) => s.id));

    async function item(node) {
      const s = node.s;
      const hung = [...node.hung];
      for (const kid of kids.filter((k) => k.fork_snapshot_id === s.id)) hung.push({ at: kid.created_at, kid });
      hung.sort((a, b) => a.at.localeCompare(b.at));
      const below = [];
      for (const each of hung) below.push(each.kid ? await branch(each.kid.id, each.kid) : await drawLine(each.line));
      return h("li", { "data-snapshot": s.id },
        h("span", { class: "node snapshot" },
          h("span", { class: "kind" }, `${s.kind} snapshot`),
          h("span", { class: "mono" }, snapshotLabel(s)),
          h("span", { class: "when" }, when(s.created_at)),
          h("span", { class: "size" }, bytes(s.size_bytes)),
          id === currentId && sb ? rollbackButton(sb, s, onChange) : ""),
        below.length ? h("ul", {}, below) : "");
    }

    async function drawItems(line) {
      const drawn = [];
      for (const node of line.items) drawn.push(await item(node));
      if (line.leftBy) {
        const e = line.leftBy;
        drawn.push(h("li", { class: "left" }, h("span", { class: "node left" },
          h("span", { class: "kind" }, "then"),
          h("span", {}, "rolled back to ", h("span", { class: "mono" }, rolledTo(e))),
          h("span", { class: "when" }, when(e.at)))));
      }
      if (line === current && sb) {
        drawn.push(h("li", { class: "now" }, h("span", { class: "node now" },
          h("span", { class: "kind" }, "now"), h("span", {}, `${id} is ${sb.state} here`))));
      }
      return drawn;
    }

    async function drawLine(line) {
      const e = line.rollback;
      const items = await drawItems(line);
      return h("li", { class: "rolled", "data-rollback-event": e.id, "data-rolled-to": e.detail.snapshot_id },
        h("span", { class: "node rollback" },
          h("span", { class: "kind" }, "rolled back"),
          known.has(e.detail.snapshot_id) ? h("span", {}, "to this snapshot")
            : h("span", {}, "to ", h("span", { class: "mono" }, rolledTo(e)), " (deleted since)"),
          h("span", { class: "when" }, when(e.at))),
        items.length ? h("ul", {}, items) : "");
    }

    const list = await drawItems(own);
    for (const line of orphans) list.push(await drawLine(line));
    for (const kid of kids.filter((k) => !known.has(k.fork_snapshot_id))) list.push(await branch(kid.id, kid));
    return h("li", { class: id === rootId ? "" : "branch" }, label, list.length ? h("ul", {}, list) : "");
  }
  return h("div", { class: "tree" },
    h("ul", { "aria-label": `Snapshots, rollbacks and forks of ${rootId}` }, await branch(rootId, root)));
}
