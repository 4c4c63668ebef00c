// A terminal in the sandbox: xterm.js over the PTY WebSocket (binary frames both ways; a text frame
// {"resize": [rows, cols]} when the terminal changes size).
import { Terminal } from "../vendor/xterm/xterm.mjs";
import { FitAddon } from "../vendor/xterm-addon-fit/addon-fit.mjs";
import { ptySocket, session } from "./api.js";
import { h, replace } from "./dom.js";

export function terminalSection(sandboxId) {
  // Shown once opened: an empty black box would look like a broken terminal.
  const screen = h("div", { class: "terminal", id: "terminal", role: "region", "aria-label": "Terminal", hidden: true });
  const state = h("span", { class: "legend", "aria-live": "polite" }, "not connected");
  const connect = h("button", { type: "button", class: "primary", id: "terminal-connect",
    disabled: !session.canAct(), title: session.canAct() ? "" : "a read-only key cannot open a terminal" },
  "Open terminal");
  const section = h("section", { "aria-labelledby": "terminal-title" },
    h("h2", { id: "terminal-title" }, "Terminal"),
    h("div", { class: "toolbar" }, connect, state), screen);
  let term = null, socket = null, observer = null;
  const encoder = new TextEncoder();

  connect.addEventListener("click", () => {
    close();
    term = new Terminal({ cursorBlink: true, fontSize: 14, convertEol: false,
      fontFamily: 'ui-monospace, "DejaVu Sans Mono", Menlo, monospace' });
    const fit = new FitAddon();
    term.loadAddon(fit);
    replace(screen);
    screen.hidden = false;
    term.open(screen);
    fit.fit();
    socket = ptySocket(sandboxId, term.rows, term.cols);
    replace(state, "connecting…");
    socket.addEventListener("open", () => { replace(state, "connected"); term.focus(); });
    socket.addEventListener("close", () => {
      if (state.textContent === "connected") replace(state, "disconnected");
    });
    socket.addEventListener("error", () => replace(state, "could not connect"));
    socket.addEventListener("message", (event) => {
      if (typeof event.data !== "string") { term.write(new Uint8Array(event.data)); return; }
      // Text frames are the server's own messages (started, exit, warning, error), never terminal output.
      let message = {};
      try { message = JSON.parse(event.data); } catch (_) { return; }
      if (message.type === "exit") replace(state, `the shell exited (${message.exit_code ?? message.signal ?? "?"})`);
      else if (message.type === "error") replace(state, `error: ${message.error?.message ?? "unknown"}`);
    });
    term.onData((data) => { if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data)); });
    term.onResize(({ rows, cols }) => {
      if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ resize: [rows, cols] }));
    });
    observer = new ResizeObserver(() => fit.fit());
    observer.observe(screen);
  });

  function close() {
    if (observer) observer.disconnect();
    if (socket) socket.close();
    if (term) term.dispose();
    term = socket = observer = null;
  }
  return { section, close };
}
