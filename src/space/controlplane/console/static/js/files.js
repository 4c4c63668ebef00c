// The sandbox's files: a directory listing, upload into it, download of a file.
import { api, download, session } from "./api.js";
import { h, replace, say, bytes, when } from "./dom.js";

export function filesSection(sandboxId) {
  const id = encodeURIComponent(sandboxId);
  const path = h("input", { id: "files-path", value: ".", size: 30 });
  const body = h("tbody");
  const picker = h("input", { type: "file", id: "files-upload", disabled: !session.canAct() });
  const upload = h("button", { type: "button", id: "files-upload-button", disabled: !session.canAct() },
    "Upload");
  let current = ".";

  async function list(where) {
    try {
      const { entries } = await api("GET", `/sandboxes/${id}/files/list`, { query: { path: where, depth: 1 } });
      current = where;
      path.value = where;
      entries.sort((a, b) => (a.type === "dir") === (b.type === "dir") ? a.name.localeCompare(b.name) : a.type === "dir" ? -1 : 1);
      replace(body, entries.length ? entries.map(entryRow)
        : h("tr", {}, h("td", { colspan: 4, class: "empty" }, "Empty directory.")));
    } catch (exc) {
      replace(body, h("tr", {}, h("td", { colspan: 4, class: "error" }, exc.message)));
    }
  }

  function entryRow(entry) {
    const name = entry.type === "dir"
      ? h("button", { type: "button", class: "small", onclick: () => list(entry.path) }, `${entry.name}/`)
      : h("span", {}, entry.name);
    const get = entry.type === "file"
      ? h("button", { type: "button", class: "small", "aria-label": `Download ${entry.name}`,
        onclick: () => download(sandboxId, entry.path).catch((exc) => say(exc.message, true)) }, "Download")
      : "";
    return h("tr", { "data-name": entry.name },
      h("td", { class: "mono", "data-label": "Name" }, name),
      h("td", { "data-label": "Size" }, entry.type === "file" ? bytes(entry.size) : entry.type),
      h("td", { "data-label": "Modified" }, when(entry.modified)),
      h("td", { "data-label": "" }, get));
  }

  upload.addEventListener("click", async () => {
    const file = picker.files[0];
    if (!file) { say("Choose a file first", true); return; }
    const target = `${current.replace(/\/$/, "")}/${file.name}`;
    try {
      await api("PUT", `/sandboxes/${id}/files`, { query: { path: target }, body: file,
        contentType: "application/octet-stream" });
      say(`Uploaded ${file.name}`);
      picker.value = "";
      await list(current);
    } catch (exc) {
      say(`upload refused: ${exc.message}`, true);
    }
  });

  const up = h("button", { type: "button", onclick: () => {
    const parent = current === "." || current === "/" ? current : current.replace(/\/[^/]*\/?$/, "") || "/";
    list(parent);
  } }, "Up");
  const go = h("button", { type: "button", onclick: () => list(path.value.trim() || ".") }, "List");
  path.addEventListener("keydown", (e) => { if (e.key === "Enter") list(path.value.trim() || "."); });

  const section = h("section", { "aria-labelledby": "files-title" },
    h("h2", { id: "files-title" }, "Files"),
    h("div", { class: "toolbar" }, h("label", { for: "files-path", class: "visually-hidden" }, "Directory"),
      path, go, up,
      h("label", { for: "files-upload", class: "visually-hidden" }, "File to upload"), picker, upload),
    h("table", { "aria-label": "Files" },
      h("thead", {}, h("tr", {}, ["Name", "Size", "Modified", ""].map((t) => h("th", { scope: "col" }, t)))),
      body));
  return { section, load: () => list(current) };
}
