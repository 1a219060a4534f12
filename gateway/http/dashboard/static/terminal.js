// A terminal in the page over GET /v1/sandboxes/{id}/terminal (a WebSocket). Browsers
// cannot set headers on a WebSocket, so the key goes as a subprotocol
// ("agentbox.key.KEY", beside "agentbox.terminal", which the server answers): a header,
// never the URL. The screen is a small line-based emulator: text, CR/LF, backspace and the
// cursor/erase sequences a shell's line editor uses; other escape sequences are dropped.
import { session } from "./api.js";
import { h } from "./dom.js";

const COLS = 100, ROWS = 30, KEEP = 2000;
const KEYS = { Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b", ArrowUp: "\x1b[A",
               ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D", Home: "\x1b[H",
               End: "\x1b[F", Delete: "\x1b[3~" };

export class Screen {
  constructor(el) {
    this.el = el;
    this.lines = [""];
    this.col = 0;
    this.pending = "";  // an escape sequence split across frames
  }

  write(text) {
    let s = this.pending + text;
    this.pending = "";
    for (let i = 0; i < s.length; i++) {
      const c = s[i];
      if (c === "\x1b") {
        const end = this.escape(s, i);
        if (end < 0) { this.pending = s.slice(i); break; }
        i = end;
      } else if (c === "\n") {
        this.lines.push("");
        this.col = 0;
      } else if (c === "\r") this.col = 0;
      else if (c === "\b") this.col = Math.max(0, this.col - 1);
      else if (c >= " " || c === "\t") this.put(c);
    }
    if (this.lines.length > KEEP) this.lines.splice(0, this.lines.length - KEEP);
    this.el.textContent = this.lines.join("\n");
    this.el.scrollTop = this.el.scrollHeight;
  }

  put(c) {
    const line = this.lines[this.lines.length - 1].padEnd(this.col);
    this.lines[this.lines.length - 1] = line.slice(0, this.col) + c + line.slice(this.col + 1);
    this.col++;
  }

  // Handle the sequence at s[i] (ESC); the index of its last char, -1 if incomplete.
  escape(s, i) {
    if (i + 1 >= s.length) return -1;
    if (s[i + 1] === "]") {  // OSC ... BEL or ST (a window title): dropped
      for (let j = i + 2; j < s.length; j++) {
        if (s[j] === "\x07") return j;
        if (s[j] === "\x1b" && s[j + 1] === "\\") return j + 1;
      }
      return -1;
    }
    if (s[i + 1] !== "[") return i + 1;
    let j = i + 2;
    while (j < s.length && !(s[j] >= "@" && s[j] <= "~")) j++;
    if (j >= s.length) return -1;
    const n = parseInt(s.slice(i + 2, j), 10) || 1;
    const line = this.lines[this.lines.length - 1];
    if (s[j] === "K") this.lines[this.lines.length - 1] = line.slice(0, this.col);
    else if (s[j] === "C") this.col += n;
    else if (s[j] === "D") this.col = Math.max(0, this.col - n);
    else if (s[j] === "J" && s.slice(i + 2, j) === "2") { this.lines = [""]; this.col = 0; }
    return j;
  }
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
  open.addEventListener("click", () => {
    if (ws) ws.close();
    const term = new Screen(screen);
    const decoder = new TextDecoder();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${scheme}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}`
                       + `/terminal?cols=${COLS}&rows=${ROWS}`,
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
  signal.addEventListener("abort", () => ws?.close());
  return h("div", { class: "term" }, h("div", {}, open, " ", status), screen);
}
