// Templates (built-in and the key's own: state, build progress) and Dockerfile builds
// (start one from a context tar, follow its log as it streams).
import { api, lines } from "./api.js";
import { act, bytes, clear, h, toast, when } from "./dom.js";

function progress(t) {
  const p = t.progress;
  if (!p) return t.error || "";
  return `${p.stage} (${p.stage_index}/${p.stages}, ${Math.round(p.elapsed_s)} s) ${p.last}`;
}

export async function templatesView(main, { signal }) {
  const body = h("tbody", { id: "templates" });
  const log = h("pre", { class: "console", id: "build-log" });
  const buildState = h("p", { id: "build-state" });
  main.append(h("h2", {}, "Templates"),
    h("table", { class: "grid" }, h("thead", {}, h("tr", {},
      ["name", "owner", "source", "state", "progress / error", "size", "created"].map(
        (t) => h("th", {}, t)))), body),
    h("h3", {}, "Build from a Dockerfile"), buildForm(follow), buildState, log);

  async function load() {
    const { templates } = await api("GET", "/v1/templates", { signal });
    clear(body).append(...templates.map((t) => h("tr", { dataset: { name: t.name } },
      h("td", {}, t.name, t.default ? " (default)" : ""), h("td", {}, t.owner ?? ""),
      h("td", {}, t.source ?? ""), h("td", {}, t.state ?? ""), h("td", {}, progress(t)),
      h("td", {}, t.size_bytes ? bytes(t.size_bytes) : ""), h("td", {}, when(t.created_at)))));
  }

  async function follow(id) {
    log.textContent = "";
    const path = `/v1/templates/builds/${encodeURIComponent(id)}`;
    const resp = await api("GET", `${path}/log`, { raw: true, signal });
    for await (const line of lines(resp)) {
      if (!line) continue;
      const ev = JSON.parse(line);
      const text = ev.type === "step" ? `== step ${ev.n}/${ev.of}: ${ev.text}${ev.cached ? " (cached)" : ""}`
        : ev.type === "output" ? ev.text.replace(/\n$/, "")
        : ev.type === "error" ? `error: ${ev.message}` : ev.type === "done" ? "done" : null;
      if (text !== null) log.append(text + "\n");
      log.scrollTop = log.scrollHeight;
    }
    const { build } = await api("GET", path, { signal });
    buildState.textContent = `build ${build.id}: ${build.state}${build.error ? " - " + build.error : ""}`;
    await load();
  }

  const timer = setInterval(() => load().catch(() => {}), 5000);  // build progress
  signal.addEventListener("abort", () => clearInterval(timer));
  await load();
}

function buildForm(follow) {
  const name = h("input", { name: "name", placeholder: "template name", required: true, size: 16 });
  const tar = h("input", { type: "file", name: "context", accept: ".tar,application/x-tar" });
  const go = h("button", { type: "submit" }, "Build");
  const existing = h("input", { name: "build", placeholder: "or a build id to follow", size: 20 });
  const form = h("form", { class: "build" }, name, " context tar: ", tar, go, " ", existing);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    act(go, async () => {
      if (existing.value.trim()) return follow(existing.value.trim());
      if (!tar.files.length) return toast("choose the build context (a tar with a Dockerfile)");
      const { build } = await api("POST", `/v1/templates/builds?name=${encodeURIComponent(name.value.trim())}`,
                                  { body: tar.files[0], headers: { "Content-Type": "application/x-tar" } });
      toast(`build ${build.id} started`, "info");
      await follow(build.id);
    });
  });
  return form;
}
