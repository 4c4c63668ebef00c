// The console's entry point: sign-in state, the hash router (#/sandboxes, #/sandboxes/<id>, #/nodes,
// #/credentials; the server only ever serves fixed files) and the page frame.
import { api, session } from "./api.js";
import { h, replace } from "./dom.js";
import { live } from "./live.js";
import { signInPage } from "./signin.js";
import { sandboxesPage } from "./sandboxes.js";
import { sandboxPage } from "./sandbox.js";
import { nodesPage } from "./nodes.js";
import { credentialsPage } from "./credentials.js";

const main = document.getElementById("main");
let leave = null; // the current page's clean-up (streams, sockets)

function parse(hash) {
  const parts = hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] || "sandboxes", id: parts[1] };
}

async function ensureSignedIn() {
  if (!session.key()) return false;
  if (session.me) return true;
  try {
    session.me = await api("GET", "/whoami");
    return true;
  } catch (_) {
    session.clear();
    return false;
  }
}

function frame(page) {
  const top = document.getElementById("top");
  top.hidden = false;
  for (const link of top.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const me = session.me;
  replace(document.getElementById("who"),
    `${me.org_key ? "org" : "project"} key ${me.key_prefix}… · ${me.role} · ${me.project_id}`);
}

async function route() {
  if (leave) { leave(); leave = null; }
  const { page, id } = parse(location.hash);
  if (!(await ensureSignedIn())) {
    document.getElementById("top").hidden = true;
    live.stop();
    leave = signInPage(main, () => { location.hash = "#/sandboxes"; route(); });
    return;
  }
  frame(page === "sandbox" ? "sandboxes" : page);
  live.start();
  const pages = {
    sandboxes: () => (id ? sandboxPage(main, id) : sandboxesPage(main)),
    nodes: () => nodesPage(main),
    credentials: () => credentialsPage(main),
  };
  leave = (pages[page] || (() => { replace(main, h("h1", {}, "Not found")); return null; }))();
  main.focus({ preventScroll: true });
}

document.getElementById("signout").addEventListener("click", () => {
  session.clear();
  live.stop();
  location.hash = "#/signin";
  route();
});
window.addEventListener("space:unauthenticated", () => {
  // The key was revoked while signed in: back to the sign-in page (a refused sign-in handles its own).
  if (!session.me) return;
  session.clear();
  live.stop();
  route();
});
window.addEventListener("hashchange", route);
route();
