// DOM building without innerHTML: text is always text (textContent), so nothing the API returns can
// become markup or script.

export function h(tag, attrs = {}, ...children) {
  const el = tag.startsWith("svg:")
    ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// A form control with its visible label (the label holds only its text, so the control's accessible name
// is exactly that text).
export function field(text, control) {
  return h("div", { class: "field" }, h("label", { for: control.id }, text), control);
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return isNaN(d) ? String(iso) : d.toLocaleString();
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

let statusTimer = null;
export function say(message, bad = false) {
  const box = document.getElementById("status");
  box.textContent = message;
  box.classList.toggle("bad", bad);
  clearTimeout(statusTimer);
  statusTimer = setTimeout(() => { box.textContent = ""; }, bad ? 8000 : 4000);
}

// A modal confirmation (the page's one <dialog>): resolves true only on an explicit "Confirm".
export function confirmAction(title, text, okLabel = "Confirm") {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    document.getElementById("confirm-cancel").focus();
  });
}
