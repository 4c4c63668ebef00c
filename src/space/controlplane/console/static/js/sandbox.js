// One sandbox: its facts and actions (live), a terminal, its files, its snapshot tree, metrics, egress.
import { api } from "./api.js";
import { h, replace, when, bytes } from "./dom.js";
import { live } from "./live.js";
import { actionButtons, badge } from "./sandboxes.js";
import { terminalSection } from "./terminal.js";
import { filesSection } from "./files.js";
import { drawTree } from "./tree.js";
import { auditTable } from "./audit.js";

function facts(sb) {
  const rows = [
    ["State", badge(sb)], ["Template", sb.template], ["Node", sb.node_id || "–"],
    ["Created", when(sb.created_at)], ["Last activity", when(sb.last_activity_at)],
    ["Limits", `${sb.limits.cpus} CPU · ${sb.limits.memory_mb} MiB · disk ${sb.limits.disk_mb} MiB`],
    ["Expires", sb.expires_at ? `${when(sb.expires_at)} (${sb.on_timeout})` : "never"],
    ["Forked from", sb.forked_from ? h("a", { href: `#/sandboxes/${sb.forked_from}`, class: "mono" }, sb.forked_from) : "–"],
    ["Metadata", Object.entries(sb.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "–"],
  ];
  if (sb.error) rows.push(["Error", h("span", { class: "error" }, sb.error)]);
  if (sb.notice) rows.push(["Notice", sb.notice]);
  return h("dl", { class: "facts" }, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

function chart(samples) {
  const width = 600, height = 150, pad = 20;
  if (!samples.length) return h("p", { class: "empty" }, "No samples yet (taken every few seconds while running).");
  const t0 = samples[0].timestamp, t1 = samples[samples.length - 1].timestamp || t0 + 1;
  const x = (t) => pad + ((t - t0) / Math.max(1, t1 - t0)) * (width - 2 * pad);
  const y = (pct) => height - pad - (Math.min(100, Math.max(0, pct)) / 100) * (height - 2 * pad);
  const line = (pick) => samples.filter((s) => pick(s) !== null)
    .map((s) => `${x(s.timestamp).toFixed(1)},${y(pick(s)).toFixed(1)}`).join(" ");
  const mem = (s) => (s.mem_used_bytes !== null && s.mem_total_bytes ? (100 * s.mem_used_bytes) / s.mem_total_bytes : null);
  const last = samples[samples.length - 1];
  return [
    h("svg:svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img",
      "aria-label": `CPU ${last.cpu_used_pct ?? "–"}%, memory ${bytes(last.mem_used_bytes)} of ${bytes(last.mem_total_bytes)}` },
    h("svg:polyline", { class: "cpu", points: line((s) => s.cpu_used_pct) }),
    h("svg:polyline", { class: "mem", points: line(mem) })),
    h("p", { class: "legend" }, h("span", { class: "cpu" }, "■ CPU % of limit"), " ",
      h("span", { class: "mem" }, "■ memory % of limit"), " (0–100 %, oldest on the left)",
      ` · last: CPU ${last.cpu_used_pct === null ? "–" : last.cpu_used_pct.toFixed(1)}%, memory ${bytes(last.mem_used_bytes)}, disk ${bytes(last.disk_used_bytes)}`),
  ];
}

function egressView(policy) {
  const list = (items) => (items && items.length ? items.join(", ") : "–");
  return h("dl", { class: "facts" },
    h("dt", {}, "Allowed hosts"), h("dd", { class: "mono" }, list(policy.allow)),
    h("dt", {}, "Denied hosts"), h("dd", { class: "mono" }, list(policy.deny)),
    h("dt", {}, "Credentials"), h("dd", { class: "mono" }, list(policy.credentials)));
}

export function sandboxPage(main, sandboxId) {
  const id = encodeURIComponent(sandboxId);
  const title = h("h1", { class: "mono" }, sandboxId);
  const info = h("div", { class: "panel" }, "Loading…");
  const actions = h("div", { class: "toolbar", role: "group", "aria-label": "Actions" });
  const tree = h("div", { id: "tree" }, "Loading…");
  const metrics = h("div", { id: "metrics" });
  const egress = h("div", { id: "egress", class: "panel" });
  const audit = h("div", { id: "audit" });
  const terminal = terminalSection(sandboxId);
  const files = filesSection(sandboxId);
  let shown = null, timer = null;

  let drawing = 0; // refreshes overlap (a live update during a rollback): only the newest one is shown
  async function refreshTree() {
    const mine = ++drawing;
    let drawn;
    try { drawn = await drawTree(sandboxId, { onChange: refreshTree }); } catch (exc) { drawn = exc.message; }
    if (mine === drawing) replace(tree, drawn);
  }
  async function refreshMetrics() {
    try {
      const start = Math.floor(Date.now() / 1000) - 3600;
      replace(metrics, chart((await api("GET", `/sandboxes/${id}/metrics`, { query: { start } })).samples));
    } catch (exc) { replace(metrics, h("p", { class: "empty" }, exc.message)); }
  }

  function render() {
    const sb = live.sandboxes.get(sandboxId);
    if (!sb || sb === shown) return;
    const first = shown === null;
    shown = sb;
    replace(info, facts(sb));
    replace(actions, actionButtons(sb, { onDone: (name) => {
      if (name === "delete") location.hash = "#/sandboxes";
      else refreshTree();
    } }));
    if (first) { files.load(); refreshMetrics(); }
    refreshTree();
  }

  replace(main, title,
    h("div", { class: "grid" },
      h("section", { "aria-labelledby": "facts-title" }, h("h2", { id: "facts-title" }, "Sandbox"), actions, info),
      h("section", { "aria-labelledby": "egress-title" }, h("h2", { id: "egress-title" }, "Egress policy"), egress)),
    terminal.section, files.section,
    h("section", { "aria-labelledby": "tree-title" }, h("h2", { id: "tree-title" }, "Snapshots, rollbacks and forks"), tree),
    h("section", { "aria-labelledby": "metrics-title" }, h("h2", { id: "metrics-title" }, "Metrics (last hour)"), metrics),
    h("section", { "aria-labelledby": "audit-title" }, h("h2", { id: "audit-title" }, "Credential use"), audit));

  api("GET", `/sandboxes/${id}`).then((sb) => { if (!live.sandboxes.has(sb.id)) live.put(sb); })
    .catch((exc) => { replace(info, h("p", { class: "error" }, exc.message)); replace(tree, ""); });
  api("GET", `/sandboxes/${id}/egress`).then((p) => {
    replace(egress, egressView(p));
    auditTable(sandboxId, p.credentials).then((table) => replace(audit, table))
      .catch((exc) => replace(audit, h("p", { class: "empty" }, exc.message)));
  }).catch((exc) => replace(egress, h("p", { class: "empty" }, exc.message)));
  timer = setInterval(refreshMetrics, 15000);
  const unsubscribe = live.subscribe(render);
  return () => { unsubscribe(); clearInterval(timer); terminal.close(); };
}
