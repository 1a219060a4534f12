// A file browser over the files API: list a directory, go into one, download a file
// (fetched with the key, handed to the browser as a blob), upload into the directory.
// Nothing loads until asked: any file call wakes a sleeping sandbox.
import { api } from "./api.js";
import { act, bytes, clear, h, toast, when } from "./dom.js";

function join(dir, name) {
  return `${dir.replace(/\/+$/, "")}/${name}`;
}

function apiPath(id, kind, path) {
  const enc = path.split("/").filter(Boolean).map(encodeURIComponent).join("/");
  return `/v1/sandboxes/${encodeURIComponent(id)}/${kind}/${enc}`;
}

export function filesPanel(id, signal) {
  const dir = h("input", { name: "dir", id: "files-dir", value: "/tmp", size: 40 });
  const list = h("tbody", { id: "files" });
  const upload = h("input", { type: "file", id: "files-upload", multiple: true });
  const open = h("button", { type: "submit", id: "files-open" }, "Open");
  const nav = h("form", { class: "files-nav" }, dir, open);

  async function show(path) {
    dir.value = path;
    const listing = await api("GET", apiPath(id, "files", path), { signal });
    const up = path.replace(/\/[^/]+\/?$/, "") || "/";
    clear(list).append(
      path !== "/" ? h("tr", {}, h("td", {}, h("a", { href: "#", onclick: (ev) => {
        ev.preventDefault(); show(up).catch((e) => toast(e.message));
      } }, "..")), h("td", {}), h("td", {})) : null,
      ...listing.entries.map((e) => entryRow(e, path)));
  }

  function entryRow(entry, path) {
    const full = join(path, entry.name);
    const name = h("a", { href: "#", class: `file-${entry.type}`, onclick: (ev) => {
      ev.preventDefault();
      const go = entry.type === "dir" ? show(full) : download(id, full, entry.name, signal);
      go.catch((e) => toast(e.message));
    } }, entry.type === "dir" ? `${entry.name}/` : entry.name);
    return h("tr", { dataset: { name: entry.name } }, h("td", {}, name),
             h("td", {}, entry.type === "dir" ? "" : bytes(entry.size)),
             h("td", {}, when(entry.mtime)));
  }

  nav.addEventListener("submit", (ev) => {
    ev.preventDefault();
    act(open, () => show(dir.value.trim() || "/"));
  });
  upload.addEventListener("change", () => act(upload, async () => {
    for (const file of upload.files) {
      const target = join(dir.value.trim() || "/", file.name);
      await api("PUT", `/v1/sandboxes/${encodeURIComponent(id)}/files?path=`
                       + encodeURIComponent(target), { body: file,
                       headers: { "Content-Type": "application/octet-stream" } });
      toast(`uploaded ${target}`, "info");
    }
    upload.value = "";
    await show(dir.value.trim() || "/");
  }));
  return h("div", { class: "filebrowser" }, nav,
           h("label", {}, "Upload to this directory: ", upload),
           h("table", { class: "grid" }, h("thead", {}, h("tr", {},
             h("th", {}, "name"), h("th", {}, "size"), h("th", {}, "modified"))), list));
}

async function download(id, path, name, signal) {
  const resp = await api("GET", apiPath(id, "files", path), { raw: true, signal });
  const url = URL.createObjectURL(await resp.blob());
  const a = h("a", { href: url, download: name, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
