// Usage per key over time: the window is cut into buckets, GET /v1/usage is asked for each
// (every key with ?key=* for an admin), and each key gets a bar chart (SVG, built with DOM
// calls) of the chosen measure.
import { api, session } from "./api.js";
import { clear, h } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const MEASURES = ["vcpu_seconds", "gib_seconds", "awake_seconds", "suspended_seconds",
                  "snapshot_gib_hours", "restores", "created", "destroyed"];
const WINDOWS = { "last hour": 3600, "last 24 hours": 86400, "last 7 days": 7 * 86400 };
const BUCKETS = 12;

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  el.append(...children);
  return el;
}

export function chart(values, labels, title) {
  const w = 480, hgt = 140, pad = 24, max = Math.max(...values, 1e-9);
  const bw = (w - pad) / values.length;
  const bars = values.map((v, i) => {
    const bh = ((hgt - pad) * v) / max;
    return svg("rect", { x: pad + i * bw + 2, y: hgt - pad - bh, width: bw - 4,
                         height: Math.max(bh, 0), class: "bar" },
               svg("title", {}, `${labels[i]}: ${v.toFixed(2)}`));
  });
  return svg("svg", { viewBox: `0 0 ${w} ${hgt}`, width: w, height: hgt, class: "chart",
                      role: "img", "aria-label": title },
    ...bars,
    svg("text", { x: pad, y: 12, class: "axis" }, `max ${max.toFixed(2)}`),
    svg("text", { x: pad, y: hgt - 6, class: "axis" }, labels[0]),
    svg("text", { x: w - 4, y: hgt - 6, class: "axis", "text-anchor": "end" },
        labels[labels.length - 1]));
}

export async function usageView(main, { signal }) {
  const measure = h("select", { name: "measure" }, MEASURES.map((m) => h("option", { value: m }, m)));
  const span = h("select", { name: "window" },
    Object.keys(WINDOWS).map((k) => h("option", { value: WINDOWS[k] }, k)));
  const charts = h("div", { id: "usage-charts" });
  main.append(h("h2", {}, "Usage"), h("form", { class: "filters" }, measure, span), charts);
  let data = null;
  const names = new Map();  // key id -> name (an admin key can list them)
  if (session.admin) {
    for (const k of (await api("GET", "/v1/keys?revoked=1", { signal })).keys) names.set(k.id, k.name);
  }

  async function load() {
    const now = Date.now() / 1000, step = Number(span.value) / BUCKETS;
    const buckets = [];
    for (let i = 0; i < BUCKETS; i++) {
      const from = now - (BUCKETS - i) * step, to = from + step;
      const q = new URLSearchParams({ from, to });
      if (session.admin) q.set("key", "*");
      buckets.push({ from, usage: await api("GET", `/v1/usage?${q}`, { signal }) });
    }
    data = buckets;
    draw();
  }

  function draw() {
    const keys = new Set(data.flatMap((b) => b.usage.keys.map((k) => k.key)));
    const labels = data.map((b) => new Date(b.from * 1000).toLocaleTimeString());
    clear(charts);
    for (const key of keys) {
      const values = data.map((b) => b.usage.keys.find((k) => k.key === key)?.[measure.value] ?? 0);
      charts.append(h("section", { class: "usage-key", dataset: { key } },
        h("h3", {}, `${names.get(key) ?? key} (${key}): ${measure.value}`),
        chart(values, labels, `${key} ${measure.value}`)));
    }
    if (!keys.size) charts.append(h("p", {}, "no usage in this window"));
  }

  measure.addEventListener("change", () => data && draw());
  span.addEventListener("change", () => load());
  await load();
}
