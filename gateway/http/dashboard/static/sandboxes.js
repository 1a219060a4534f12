// The sandboxes page: filter, page, act (suspend, wake, delete), create; rows follow the
// live feed without a reload. An admin key sees every key's sandboxes by default ("all
// keys": one listing per key, merged; paging is per key there) or picks one key.
import { api, session } from "./api.js";
import { act, age, clear, h, metadataText, stateBadge, toast } from "./dom.js";

const STATES = ["", "running", "paused", "suspended", "failed", "creating", "restoring",
                "suspending"];
const PAGE = 25;
const MAX_KEYS = 50;  // "all keys" lists at most this many keys' sandboxes

function shape(sb) {
  return sb.vcpus ? `${sb.vcpus} vCPU, ${sb.memory_mib} MiB, ${sb.disk_mib} MiB disk` : "-";
}

export async function sandboxesView(main, { signal, feed }) {
  const filters = { state: "", template: "", metadata: "", tenant: session.admin ? "*" : "" };
  let cursors = [null];  // the cursor of each page shown so far
  let keys = null;  // admin: every key, for "all keys" and the key column
  const body = h("tbody", { id: "sandbox-rows" });
  const pager = h("div", { class: "pager" });
  const note = h("p", { class: "note", id: "sandboxes-note" });
  const form = filterForm(filters, () => { cursors = [null]; load(); });
  const heads = ["id", "state", "template", "shape", "age", "last activity", "metadata", ""];
  if (session.admin) heads.splice(1, 0, "key");
  main.append(h("h2", {}, "Sandboxes"), createForm(() => load()), form,
    h("table", { class: "grid", id: "sandboxes" },
      h("thead", {}, h("tr", {}, heads.map((t) => h("th", {}, t)))), body), pager, note);
  let picker = null, keysAt = 0;
  async function loadKeys() {  // again at "all keys" loads (keys come and go), 1/s at most
    if (Date.now() - keysAt < 1000) return;
    keysAt = Date.now();
    keys = (await api("GET", "/v1/keys?revoked=1", { signal })).keys;
    const fresh = tenantPicker(keys, filters, () => { cursors = [null]; load(); });
    if (picker) picker.replaceWith(fresh);
    else form.prepend(fresh);
    picker = fresh;
  }
  if (session.admin) await loadKeys();

  function query(tenant, cursor) {
    const q = new URLSearchParams({ limit: PAGE });
    if (filters.state) q.set("state", filters.state);
    if (filters.template) q.set("template", filters.template);
    for (const pair of filters.metadata.split(",").map((p) => p.trim()).filter(Boolean)) {
      const eq = pair.indexOf("=");
      if (eq > 0) q.set(`metadata.${pair.slice(0, eq)}`, pair.slice(eq + 1));
    }
    if (tenant) q.set("tenant", tenant);
    if (cursor) q.set("cursor", cursor);
    return `/v1/sandboxes?${q}`;
  }

  // A fleet's list names the hosts that did not answer (docs/cluster.md): say so.
  function missing(hosts) {
    const names = [...new Set(hosts)].sort();
    return names.length ? `Hosts not answering, their sandboxes missing: ${names.join(", ")}.` : "";
  }

  // [{sb, key}] of every key (key null: the signed-in key's own, which can do everything).
  async function everyKey() {
    await loadKeys();
    const listed = [...keys.filter((k) => k.id === session.keyId),
                    ...keys.filter((k) => k.id !== session.keyId)].slice(0, MAX_KEYS);
    const pages = await Promise.all(listed.map((k) => {
      const own = k.id === session.keyId;
      return api("GET", query(own ? "" : k.id, null), { signal })
        .then((p) => ({ key: own ? null : k, p }));
    }));
    const rows = pages.flatMap(({ key, p }) => p.sandboxes.map((sb) => ({ sb, key })));
    const more = pages.some(({ p }) => p.next_cursor);
    note.textContent = (more ? `Showing the first ${PAGE} of each key's; pick a key to page. ` : "")
      + (keys.length > MAX_KEYS ? `Only the first ${MAX_KEYS} keys are listed. ` : "")
      + missing(pages.flatMap(({ p }) => p.partial ?? []));
    return rows.sort((a, b) => a.sb.created_at - b.sb.created_at);
  }

  async function load() {
    let rows, next = null;
    if (filters.tenant === "*") {
      rows = await everyKey();
    } else {
      const page = await api("GET", query(filters.tenant, cursors[cursors.length - 1]), { signal });
      const key = keys?.find((k) => k.id === filters.tenant) ?? null;
      rows = page.sandboxes.map((sb) => ({ sb, key }));
      next = page.next_cursor;
      note.textContent = missing(page.partial ?? []);
    }
    clear(body).append(...rows.map(({ sb, key }) => row(sb, key, session.admin, load)));
    if (!rows.length) body.append(h("tr", {}, h("td", { colspan: heads.length }, "none")));
    clear(pager).append(
      h("button", { type: "button", disabled: cursors.length < 2,
                    onclick: () => { cursors.pop(); load(); } }, "Previous"),
      h("button", { type: "button", disabled: !next,
                    onclick: () => { cursors.push(next); load(); } }, "Next"));
  }

  let timer = null, last = 0;  // reloads for unseen sandboxes: at most one a second
  const reloadSoon = () => {
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      last = Date.now();
      load().catch(() => {});
    }, Math.max(0, 1000 - (Date.now() - last)));
  };
  signal.addEventListener("abort", () => clearTimeout(timer));
  const onTransition = (ev) => {
    const t = ev.detail;
    const tr = body.querySelector(`tr[data-id="${CSS.escape(t.sandbox_id)}"]`);
    if (!tr) {  // a new sandbox, or one just given to a key (a warm-pool claim): reload
      if (t.to === "destroyed") return;
      if (keys && !keys.some((k) => k.id === t.tenant)) keysAt = 0;  // a key new to us
      reloadSoon();
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

// key: the owning key's record when an admin looks at another key's sandbox (null: the
// signed-in key's own). Suspend and wake act only on the key's own sandboxes (the API's
// rule); an admin may delete any.
function row(sb, key, showKey, reload) {
  const tq = key ? `?tenant=${encodeURIComponent(key.id)}` : "";
  const path = `/v1/sandboxes/${encodeURIComponent(sb.id)}`;
  const button = (label, fn) => h("button", { type: "button", class: `act-${label.toLowerCase()}`,
    onclick: (ev) => act(ev.currentTarget, fn) }, label);
  return h("tr", { dataset: { id: sb.id } },
    h("td", {}, h("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}${tq}` }, sb.id)),
    showKey ? h("td", { class: "key-cell" }, key ? key.name : "(this key)") : null,
    h("td", { class: "state-cell" }, stateBadge(sb.state)),
    h("td", {}, sb.template),
    h("td", {}, shape(sb)),
    h("td", { title: new Date(sb.created_at * 1000).toLocaleString() }, age(sb.created_at)),
    h("td", { class: "activity-cell" }, age(sb.last_activity)),
    h("td", { class: "metadata" }, metadataText(sb.metadata)),
    h("td", { class: "actions" },
      key ? null : button("Suspend", () => api("POST", `${path}/suspend`)),
      key ? null : button("Wake", () => api("POST", `${path}/resume`)),
      button("Delete", async () => {
        if (!confirm(`Delete sandbox ${sb.id}?`)) return;
        await api("DELETE", `${path}${tq}`);
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

function tenantPicker(keys, filters, apply) {
  const pick = h("select", { name: "tenant", id: "tenant", title: "whose sandboxes (admin)" },
    h("option", { value: "*" }, "all keys"),
    h("option", { value: "" }, "this key"),
    keys.filter((k) => k.id !== session.keyId).map((k) => h("option", { value: k.id },
      `${k.name} (${k.id})${k.revoked ? " revoked" : ""}`)));
  pick.value = filters.tenant;
  pick.addEventListener("change", () => { filters.tenant = pick.value; apply(); });
  return pick;
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
