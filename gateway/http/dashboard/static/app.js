// Sign-in, navigation (#/... routes) and the one live feed every view listens to.
import { api, session, sse } from "./api.js";
import { clear, h, toast } from "./dom.js";
import { sandboxesView } from "./sandboxes.js";
import { sandboxView } from "./sandbox.js";
import { templatesView } from "./templates.js";
import { keysView } from "./keys.js";
import { usageView } from "./usage.js";

// Transitions from GET /v1/events: "transition" (detail: the TransitionEvent) and "reload"
// (the feed reconnected or fell behind: what a view shows may be stale).
export const feed = new EventTarget();
const main = document.getElementById("main");
let feedAbort = null;
let viewAbort = null;

const ROUTES = [
  [/^#\/sandboxes$/, () => sandboxesView],
  [/^#\/sandbox\/([A-Za-z0-9_-]+)(?:\?tenant=([A-Za-z0-9_-]+))?$/, () => sandboxView],
  [/^#\/templates$/, () => templatesView],
  [/^#\/keys$/, () => keysView],
  [/^#\/usage$/, () => usageView],
];

function signInForm() {
  const input = h("input", { type: "password", id: "key", name: "key", autocomplete: "off",
                             placeholder: "API key (ab_...)", required: true, size: 50 });
  const form = h("form", { id: "signin", class: "card" },
    h("h2", {}, "Sign in"),
    h("p", {}, "Paste an API key. It stays in this tab (sessionStorage) and is sent only in "
               + "the Authorization header."),
    input, " ", h("button", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    session.set(input.value.trim());
    input.value = "";
    try {
      await start();
    } catch (err) {
      session.clear();
      toast(`sign-in failed: ${err.message}`);
    }
  });
  clear(main).append(form);
  input.focus();
}

async function start() {
  const { key } = await api("GET", "/v1/info");  // who this key is
  session.admin = Boolean(key?.admin);
  session.keyId = key?.id ?? null;
  document.getElementById("nav").hidden = false;
  document.getElementById("nav-keys").hidden = !session.admin;
  document.getElementById("signout").hidden = false;
  follow();
  if (!location.hash || location.hash === "#") location.hash = "#/sandboxes";
  else route();
}

function signOut() {
  session.clear();
  feedAbort?.abort();
  viewAbort?.abort();
  document.getElementById("nav").hidden = true;
  document.getElementById("signout").hidden = true;
  setLive("offline");
  signInForm();
}

function setLive(state) {
  const el = document.getElementById("live");
  el.textContent = state;
  el.dataset.state = state;
}

// Follow GET /v1/events for as long as signed in; reconnect with backoff.
async function follow() {
  feedAbort?.abort();
  const ctl = new AbortController();
  feedAbort = ctl;
  let delay = 1000;
  while (!ctl.signal.aborted && session.key) {
    try {
      for await (const rec of sse("/v1/events", ctl.signal)) {
        if (rec.event === "ready") {
          setLive("live");
          delay = 1000;
          feed.dispatchEvent(new Event("reload"));
        } else if (rec.event === "transition") {
          feed.dispatchEvent(new CustomEvent("transition", { detail: JSON.parse(rec.data) }));
        } else if (rec.event === "dropped") {
          break;
        }
      }
    } catch (err) {
      if (ctl.signal.aborted) return;
      if (err.status === 401) return;
    }
    setLive("reconnecting");
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 30000);
  }
}

function route() {
  if (!session.key) return signInForm();
  viewAbort?.abort();
  viewAbort = new AbortController();
  const found = ROUTES.find(([re]) => re.test(location.hash));
  if (!found) {
    location.hash = "#/sandboxes";
    return;
  }
  const args = location.hash.match(found[0]).slice(1);
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", location.hash.startsWith(a.getAttribute("href")));
  }
  clear(main);
  found[1]()(main, { signal: viewAbort.signal, feed, args }).catch((err) => {
    if (!viewAbort.signal.aborted) toast(err.message || String(err));
  });
}

window.addEventListener("hashchange", route);
window.addEventListener("agentbox:unauthorized", () => {
  toast("the API key was refused: sign in again");
  signOut();
});
document.getElementById("signout").addEventListener("click", signOut);
if (session.key) start().catch(() => signInForm());
else signInForm();
