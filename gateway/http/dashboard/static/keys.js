// API keys (admin): create (the secret is shown once), set limits, revoke.
import { api } from "./api.js";
import { act, clear, h, toast, when } from "./dom.js";

const LIMITS = ["max_sandboxes", "max_awake", "max_disk_mib", "rate", "burst", "max_vcpus",
                "max_memory_mib", "max_sandbox_disk_mib"];

export async function keysView(main, { signal }) {
  const body = h("tbody", { id: "keys" });
  const secret = h("p", { id: "new-secret", class: "secret" });
  main.append(h("h2", {}, "API keys"), createForm(secret, () => load()), secret,
    h("table", { class: "grid" }, h("thead", {}, h("tr", {},
      ["id", "name", "admin", "created", "limits (empty: default)", ""].map(
        (t) => h("th", {}, t)))), body));

  async function load() {
    const { keys } = await api("GET", "/v1/keys", { signal });
    clear(body).append(...keys.map((k) => keyRow(k, load)));
  }
  await load();
}

function keyRow(k, reload) {
  const inputs = LIMITS.map((name) => h("input", { name, size: 6, title: name,
    placeholder: `${name} (${k.limits[name] ?? "-"})`,
    value: k.overrides?.[name] ?? "" }));
  const save = h("button", { type: "button" }, "Save limits");
  save.addEventListener("click", () => act(save, async () => {
    const limits = {};
    for (const input of inputs) {
      limits[input.name] = input.value.trim() === "" ? null : Number(input.value);
    }
    await api("PATCH", `/v1/keys/${encodeURIComponent(k.id)}`, { json: { limits } });
    toast(`limits of ${k.name} saved`, "info");
    reload();
  }));
  const revoke = h("button", { type: "button", class: "danger" }, "Revoke");
  revoke.addEventListener("click", () => act(revoke, async () => {
    if (!confirm(`Revoke key ${k.name} (${k.id})? Its sandboxes stay.`)) return;
    await api("DELETE", `/v1/keys/${encodeURIComponent(k.id)}`);
    reload();
  }));
  return h("tr", { dataset: { id: k.id } }, h("td", {}, k.id), h("td", {}, k.name),
    h("td", {}, k.admin ? "admin" : ""), h("td", {}, when(k.created_at)),
    h("td", { class: "limits" }, inputs.map((i) => h("label", {}, i))),
    h("td", {}, save, revoke));
}

function createForm(secret, done) {
  const name = h("input", { name: "name", placeholder: "name", required: true, size: 16 });
  const admin = h("input", { type: "checkbox", name: "admin" });
  const go = h("button", { type: "submit" }, "Create key");
  const form = h("form", { class: "create" }, name, h("label", {}, admin, " admin"), go);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    act(go, async () => {
      const key = await api("POST", "/v1/keys", { json: { name: name.value.trim(),
                                                          admin: admin.checked } });
      secret.textContent = `New key ${key.id} (copy it now, it is not shown again): ${key.key}`;
      name.value = "";
      done();
    });
  });
  return form;
}
