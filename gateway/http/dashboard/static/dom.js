// Building the page without parsing HTML: every string goes in as text (textContent / a Text
// node), so a sandbox's metadata or a guest's output can never become markup.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name in el && typeof value !== "string") el[name] = value;
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  el.replaceChildren();
  return el;
}

export function toast(message, kind = "error") {
  const box = document.getElementById("toast");
  box.textContent = message;
  box.className = `toast ${kind}`;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { box.className = "toast"; box.textContent = ""; }, 6000);
}

export function age(seconds) {
  if (seconds === null || seconds === undefined || seconds <= 0) return "-";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function when(t) {
  return t ? new Date(t * 1000).toLocaleString() : "-";
}

export function stateBadge(state) {
  return h("span", { class: `state state-${state}`, dataset: { state } }, state);
}

// Run an action from a button: disabled while it runs, errors shown as a toast.
export async function act(button, fn) {
  button.disabled = true;
  try {
    return await fn();
  } catch (err) {
    toast(err.message || String(err));
  } finally {
    button.disabled = false;
  }
}

export function metadataText(meta) {
  return Object.entries(meta || {}).map(([k, v]) =>
    `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(", ");
}
