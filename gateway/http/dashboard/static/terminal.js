// A terminal in the page over GET /v1/sandboxes/{id}/terminal (a WebSocket). Browsers
// cannot set headers on a WebSocket, so the key goes as a subprotocol
// ("agentbox.key.KEY", beside "agentbox.terminal", which the server answers): a header,
// never the URL. The screen is screen.js (a small VT100/xterm emulator, text only).
import { session } from "./api.js";
import { h } from "./dom.js";
import { Screen } from "./screen.js";

const ROWS = 30;
const KEYS = { Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b", ArrowUp: "\x1b[A",
               ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D", Home: "\x1b[H",
               End: "\x1b[F", Delete: "\x1b[3~", PageUp: "\x1b[5~", PageDown: "\x1b[6~" };

// Columns that fit the <pre> (its width over one character's).
function columns(pre) {
  const probe = h("span", {}, "MMMMMMMMMM");
  pre.append(probe);
  const width = probe.getBoundingClientRect().width / 10;
  probe.remove();
  const inner = pre.clientWidth - 16;  // its padding
  return Math.max(20, Math.min(500, Math.floor(inner / (width || 8))));
}

function keyBytes(ev) {
  if (ev.ctrlKey && ev.key.length === 1 && /[a-z]/i.test(ev.key)) {
    return String.fromCharCode(ev.key.toUpperCase().charCodeAt(0) - 64);
  }
  if (KEYS[ev.key]) return KEYS[ev.key];
  if (ev.key.length === 1 && !ev.metaKey && !ev.ctrlKey) return ev.key;
  return null;
}

export function terminalPanel(id, signal) {
  const screen = h("pre", { class: "terminal", id: "terminal", tabindex: 0,
                            "aria-label": "terminal" });
  const status = h("span", { class: "term-status", id: "terminal-status" }, "closed");
  const open = h("button", { type: "button", id: "terminal-open" }, "Open terminal");
  let ws = null;
  const encoder = new TextEncoder();
  const send = (text) => ws?.readyState === WebSocket.OPEN && ws.send(encoder.encode(text));
  let term = null;
  open.addEventListener("click", () => {
    if (ws) ws.close();
    const cols = columns(screen);
    term = new Screen(ROWS, cols);
    const decoder = new TextDecoder();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${scheme}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}`
                       + `/terminal?cols=${cols}&rows=${ROWS}`,
                       ["agentbox.terminal", `agentbox.key.${session.key}`]);
    ws.binaryType = "arraybuffer";
    status.textContent = "connecting";
    ws.onopen = () => { status.textContent = "open"; screen.focus(); };
    ws.onmessage = (ev) => {
      if (typeof ev.data === "string") {
        const msg = JSON.parse(ev.data);
        if (msg.type === "exit") status.textContent = `exited (${msg.exit_code})`;
        return;
      }
      term.write(decoder.decode(ev.data, { stream: true }));
      term.render(screen);
    };
    ws.onclose = (ev) => {
      if (status.textContent === "open" || status.textContent === "connecting") {
        status.textContent = `closed (${ev.code})`;
      }
    };
  });
  screen.addEventListener("keydown", (ev) => {
    const data = keyBytes(ev);
    if (data === null) return;
    ev.preventDefault();
    send(data);
  });
  screen.addEventListener("paste", (ev) => {
    ev.preventDefault();
    send(ev.clipboardData.getData("text"));
  });
  let resizing = null;  // the window changed size: fit the columns, tell the shell
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      if (!term || ws?.readyState !== WebSocket.OPEN) return;
      const cols = columns(screen);
      if (cols === term.cols) return;
      term.resize(ROWS, cols);
      term.render(screen);
      ws.send(JSON.stringify({ type: "resize", cols, rows: ROWS }));
    }, 200);
  }, { signal });
  signal.addEventListener("abort", () => ws?.close());
  return h("div", { class: "term" }, h("div", {}, open, " ", status), screen);
}
