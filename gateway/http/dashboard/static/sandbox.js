// One sandbox: state and its transitions (with causes), console tail, CPU/memory/disk,
// preview links, a terminal and a file browser.
import { api } from "./api.js";
import { act, bytes, clear, h, metadataText, stateBadge, toast, when } from "./dom.js";
import { terminalPanel } from "./terminal.js";
import { filesPanel } from "./files.js";

// tenant: another key's id when an admin looks at that key's sandbox: it can see it and
// delete it; suspend, wake, the terminal and files are the owner's (the API's rule).
export async function sandboxView(main, { signal, feed, args: [id, tenant] }) {
  const path = `/v1/sandboxes/${encodeURIComponent(id)}`;
  const tq = tenant ? `tenant=${encodeURIComponent(tenant)}` : "";
  const sb = await api("GET", tq ? `${path}?${tq}` : path, { signal });
  const state = h("span", { id: "sandbox-state" }, stateBadge(sb.state));
  const failure = h("p", { class: "failure", id: "failure" },
                    sb.failure ? `failure: ${sb.failure}` : "");
  const events = h("tbody", { id: "transitions" });
  const consoleTail = h("pre", { class: "console", id: "console" });
  const metrics = h("dl", { class: "metrics", id: "metrics" });
  const button = (label, fn) => h("button", { type: "button",
    onclick: (ev) => act(ev.currentTarget, fn) }, label);
  const own = !tenant;
  main.append(
    h("h2", {}, "Sandbox ", h("code", {}, sb.id), " ", state),
    h("p", {}, `template ${sb.template}; created ${when(sb.created_at)}; `
               + `${sb.vcpus ?? "?"} vCPU, ${sb.memory_mib ?? "?"} MiB RAM, `
               + `${sb.disk_mib ?? "?"} MiB disk` + (tenant ? `; key ${tenant}` : "")),
    h("p", { class: "metadata" }, "metadata: ", metadataText(sb.metadata) || "none"),
    failure,
    h("div", { class: "actions" },
      own ? button("Suspend", () => api("POST", `${path}/suspend`)) : null,
      own ? button("Wake", () => api("POST", `${path}/resume`)) : null,
      button("Delete", async () => {
        if (!confirm(`Delete sandbox ${sb.id}?`)) return;
        await api("DELETE", tq ? `${path}?${tq}` : path);
        location.hash = "#/sandboxes";
      })),
    h("section", {}, h("h3", {}, "Resources"), metrics, button("Refresh", () => refresh())),
    own ? previewSection(sb) : null,
    own ? h("section", {}, h("h3", {}, "Terminal"), terminalPanel(sb.id, signal)) : null,
    own ? h("section", {}, h("h3", {}, "Files"), filesPanel(sb.id, signal)) : null,
    h("section", {}, h("h3", {}, "Transitions"),
      h("table", { class: "grid" }, h("thead", {}, h("tr", {},
        ["at", "from", "to", "event", "cause"].map((t) => h("th", {}, t)))), events)),
    h("section", {}, h("h3", {}, "Console (tail)"), consoleTail));
  const q = (extra) => `?${[extra, tq].filter(Boolean).join("&")}`;

  async function refresh() {
    const [logs, now] = await Promise.all([api("GET", `${path}/logs${q("tail=200")}`, { signal }),
                                           api("GET", `${path}${q("")}`, { signal }),
                                           refreshMetrics()]);
    failure.textContent = now.failure ? `failure: ${now.failure}` : "";
    clear(events).append(...logs.events.map((e) => eventRow(e)).reverse());
    consoleTail.textContent = logs.console.join("\n") || "(no console output)";
  }

  async function refreshMetrics() {
    const m = await api("GET", `${path}/metrics${q("")}`, { signal });
    clear(metrics).append(
      h("dt", {}, "CPU"), h("dd", {}, m.cpu_seconds == null ? "-" : `${m.cpu_seconds.toFixed(1)} s`),
      h("dt", {}, "memory"), h("dd", {}, bytes(m.memory_bytes ?? m.rss_bytes)),
      h("dt", {}, "disk"), h("dd", {}, bytes(m.disk_bytes)),
      h("dt", {}, "snapshot"), h("dd", {}, bytes(m.snapshot_bytes)));
  }

  let pending = null;  // one refresh for a burst of transitions
  const soon = () => {
    clearTimeout(pending);
    pending = setTimeout(() => refresh().catch(() => {}), 300);
  };
  feed.addEventListener("transition", (ev) => {
    const t = ev.detail;
    if (t.sandbox_id !== sb.id) return;
    state.replaceChildren(stateBadge(t.to));
    if (t.to === "destroyed") toast("this sandbox was deleted", "info");
    else soon();
  }, { signal });
  feed.addEventListener("reload", soon, { signal });
  // CPU and memory move while it runs; reading them never wakes it.
  const timer = setInterval(() => refreshMetrics().catch(() => {}), 5000);
  signal.addEventListener("abort", () => { clearInterval(timer); clearTimeout(pending); });
  await refresh();
}

function eventRow(e) {
  return h("tr", {}, h("td", {}, when(e.at)), h("td", {}, e.from ?? ""), h("td", {}, e.to),
           h("td", {}, e.event), h("td", {}, e.cause));
}

function previewSection(sb) {
  const list = h("ul", { id: "previews" });
  const port = h("input", { type: "number", min: 1, max: 65535, placeholder: "port", size: 6 });
  const link = (p) => {
    const tpl = sb.preview_url_template || "";
    let url = tpl.replace("{port}", String(p)).replace("{id}", sb.id);
    if (!/^https?:\/\//.test(url)) return null;
    if (!(sb.public_ports || []).includes(p) && sb.preview_token) {
      url += `${url.includes("?") ? "&" : "?"}token=${encodeURIComponent(sb.preview_token)}`;
    }
    return h("li", { dataset: { port: p } }, h("a", { href: url, target: "_blank",
                                                     rel: "noopener noreferrer" },
                         `port ${p}`), (sb.public_ports || []).includes(p) ? " (public)" : "");
  };
  const shown = new Set();
  const add = (p) => {
    if (shown.has(p)) return true;
    const item = link(p);
    if (item) { shown.add(p); list.append(item); }
    return Boolean(item);
  };
  (sb.public_ports || []).forEach(add);
  // Asking the guest wakes it: only on a click.
  const listen = h("button", { type: "button", id: "ports-list" }, "List listening ports");
  listen.addEventListener("click", () => act(listen, async () => {
    const { ports } = await api("GET", `/v1/sandboxes/${encodeURIComponent(sb.id)}/ports`);
    ports.forEach((p) => add(p.port));
    if (!ports.length) toast("nothing listens in the sandbox", "info");
  }));
  const form = h("form", {}, port, h("button", { type: "submit" }, "Link"), " ", listen);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const p = Number(port.value);
    if (p >= 1 && p <= 65535 && !add(p)) toast("this server has no preview URL template");
  });
  return h("section", {}, h("h3", {}, "Preview links"), list, form);
}
