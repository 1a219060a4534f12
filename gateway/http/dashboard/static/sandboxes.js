// The sandboxes page: filter, page, act (suspend, wake, delete), create; rows follow the
// live feed without a reload.
import { api, session } from "./api.js";
import { act, age, clear, h, metadataText, stateBadge, toast } from "./dom.js";

const STATES = ["", "running", "paused", "suspended", "failed", "creating", "restoring",
                "suspending"];
const PAGE = 25;

function shape(sb) {
  return sb.vcpus ? `${sb.vcpus} vCPU, ${sb.memory_mib} MiB, ${sb.disk_mib} MiB disk` : "-";
}

function tenantQuery(tenant) {
  return tenant ? `tenant=${encodeURIComponent(tenant)}` : "";
}

export async function sandboxesView(main, { signal, feed }) {
  const filters = { state: "", template: "", metadata: "", tenant: "" };
  let cursors = [null];  // the cursor of each page shown so far
  const body = h("tbody", { id: "sandbox-rows" });
  const pager = h("div", { class: "pager" });
  const form = filterForm(filters, () => { cursors = [null]; load(); });
  main.append(h("h2", {}, "Sandboxes"), createForm(() => load()), form,
    h("table", { class: "grid", id: "sandboxes" },
      h("thead", {}, h("tr", {}, ["id", "state", "template", "shape", "age", "last activity",
                                  "metadata", ""].map((t) => h("th", {}, t)))),
      body), pager);
  if (session.admin) addTenantPicker(form, filters, () => { cursors = [null]; load(); });

  async function load() {
    const q = new URLSearchParams({ limit: PAGE });
    if (filters.state) q.set("state", filters.state);
    if (filters.template) q.set("template", filters.template);
    for (const pair of filters.metadata.split(",").map((s) => s.trim()).filter(Boolean)) {
      const eq = pair.indexOf("=");
      if (eq > 0) q.set(`metadata.${pair.slice(0, eq)}`, pair.slice(eq + 1));
    }
    if (filters.tenant) q.set("tenant", filters.tenant);
    const cursor = cursors[cursors.length - 1];
    if (cursor) q.set("cursor", cursor);
    const page = await api("GET", `/v1/sandboxes?${q}`, { signal });
    clear(body).append(...page.sandboxes.map((sb) => row(sb, filters.tenant, load)));
    if (!page.sandboxes.length) body.append(h("tr", {}, h("td", { colspan: 8 }, "none")));
    clear(pager).append(
      h("button", { type: "button", disabled: cursors.length < 2,
                    onclick: () => { cursors.pop(); load(); } }, "Previous"),
      h("button", { type: "button", disabled: !page.next_cursor,
                    onclick: () => { cursors.push(page.next_cursor); load(); } }, "Next"));
  }

  const onTransition = (ev) => {
    const t = ev.detail;
    const tr = body.querySelector(`tr[data-id="${CSS.escape(t.sandbox_id)}"]`);
    if (!tr) {
      if (t.from === null) load().catch(() => {});  // a new sandbox: it may belong here
      return;
    }
    if (t.to === "destroyed") return tr.remove();
    if (filters.state && !filters.state.split(",").includes(t.to)) return tr.remove();
    tr.querySelector(".state-cell").replaceChildren(stateBadge(t.to));
    tr.querySelector(".activity-cell").textContent = age(t.at);
  };
  feed.addEventListener("transition", onTransition, { signal });
  feed.addEventListener("reload", () => load().catch(() => {}), { signal });
  await load();
}

function row(sb, tenant, reload) {
  const tq = tenantQuery(tenant);
  const path = `/v1/sandboxes/${encodeURIComponent(sb.id)}`;
  const button = (label, fn) => h("button", { type: "button", class: `act-${label.toLowerCase()}`,
    onclick: (ev) => act(ev.currentTarget, fn) }, label);
  return h("tr", { dataset: { id: sb.id } },
    h("td", {}, h("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}` }, sb.id)),
    h("td", { class: "state-cell" }, stateBadge(sb.state)),
    h("td", {}, sb.template),
    h("td", {}, shape(sb)),
    h("td", { title: new Date(sb.created_at * 1000).toLocaleString() }, age(sb.created_at)),
    h("td", { class: "activity-cell" }, age(sb.last_activity)),
    h("td", { class: "metadata" }, metadataText(sb.metadata)),
    h("td", { class: "actions" },
      button("Suspend", () => api("POST", `${path}/suspend`)),
      button("Wake", () => api("POST", `${path}/resume`)),
      button("Delete", async () => {
        if (!confirm(`Delete sandbox ${sb.id}?`)) return;
        await api("DELETE", `${path}${tq ? "?" + tq : ""}`);
        toast(`deleted ${sb.id}`, "info");
        reload();
      })));
}

function filterForm(filters, apply) {
  const state = h("select", { name: "state" }, STATES.map((s) => h("option", { value: s }, s || "any state")));
  const template = h("input", { name: "template", placeholder: "template", size: 12 });
  const metadata = h("input", { name: "metadata", placeholder: "metadata k=v, k2=v2", size: 24 });
  const form = h("form", { class: "filters", id: "filters" }, state, template, metadata,
                 h("button", { type: "submit" }, "Filter"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    Object.assign(filters, { state: state.value, template: template.value.trim(),
                             metadata: metadata.value });
    apply();
  });
  return form;
}

async function addTenantPicker(form, filters, apply) {
  const { keys } = await api("GET", "/v1/keys?revoked=1");
  const pick = h("select", { name: "tenant", title: "whose sandboxes (admin)" },
    h("option", { value: "" }, "this key"),
    keys.map((k) => h("option", { value: k.id }, `${k.name} (${k.id})${k.revoked ? " revoked" : ""}`)));
  pick.addEventListener("change", () => { filters.tenant = pick.value; apply(); });
  form.prepend(pick);
}

function createForm(done) {
  const template = h("input", { name: "template", placeholder: "template (default)", size: 14 });
  const metadata = h("input", { name: "metadata", placeholder: "metadata k=v, ...", size: 24 });
  const submit = h("button", { type: "submit" }, "Create sandbox");
  const form = h("form", { class: "create", id: "create" }, template, metadata, submit);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const body = { metadata: {} };
    if (template.value.trim()) body.template = template.value.trim();
    for (const pair of metadata.value.split(",").map((s) => s.trim()).filter(Boolean)) {
      const eq = pair.indexOf("=");
      if (eq > 0) body.metadata[pair.slice(0, eq)] = pair.slice(eq + 1);
    }
    act(submit, async () => {
      const sb = await api("POST", "/v1/sandboxes", { json: body });
      toast(`created ${sb.id}`, "info");
      done();
    });
  });
  return form;
}
