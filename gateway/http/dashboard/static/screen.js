// A small VT100/xterm screen for the terminal panel: a grid of rows x cols with a cursor,
// autowrap, scroll regions, the alternate screen (full-screen programs: less, vim, top),
// insert/delete of lines and characters, and a scrollback of the main screen. Colours and
// other attributes are dropped (SGR), as are window titles (OSC). Output is rendered with
// text nodes only: nothing the guest prints is ever parsed as HTML.
const KEEP = 2000;  // scrollback lines

export class Screen {
  constructor(rows = 24, cols = 80) {
    this.scrollback = [];
    this.pending = "";  // an escape sequence cut across two writes
    this.saved = { r: 0, c: 0 };
    this.alt = null;  // the main screen while the alternate one is shown
    this.resize(rows, cols);
  }

  resize(rows, cols) {
    const old = this.grid || [];
    this.rows = rows;
    this.cols = cols;
    this.grid = Array.from({ length: rows }, (_, i) => this.fit(old[old.length - rows + i]));
    this.top = 0;
    this.bottom = rows - 1;
    this.r = Math.min(this.r ?? 0, rows - 1);
    this.c = Math.min(this.c ?? 0, cols - 1);
    this.wrapNext = false;
  }

  fit(line) {
    const out = (line || []).slice(0, this.cols);
    while (out.length < this.cols) out.push(" ");
    return out;
  }

  blank() {
    return Array(this.cols).fill(" ");
  }

  write(text) {
    const s = this.pending + text;
    this.pending = "";
    for (let i = 0; i < s.length; i++) {
      const ch = s[i];
      if (ch === "\x1b") {
        const end = this.escape(s, i);
        if (end < 0) { this.pending = s.slice(i); break; }
        i = end;
      } else if (ch === "\n" || ch === "\x0b" || ch === "\x0c") this.lineFeed();
      else if (ch === "\r") { this.c = 0; this.wrapNext = false; }
      else if (ch === "\b") { this.c = Math.max(0, this.c - 1); this.wrapNext = false; }
      else if (ch === "\t") this.c = Math.min(this.cols - 1, (Math.floor(this.c / 8) + 1) * 8);
      else if (ch >= " " && ch !== "\x7f") this.put(ch);
    }
  }

  put(ch) {
    if (this.wrapNext) {
      this.c = 0;
      this.lineFeed();
    }
    this.grid[this.r][this.c] = ch;
    if (this.c === this.cols - 1) this.wrapNext = true;
    else this.c++;
  }

  lineFeed() {
    this.wrapNext = false;
    if (this.r === this.bottom) this.scrollUp(1);
    else if (this.r < this.rows - 1) this.r++;
  }

  scrollUp(n) {
    for (let i = 0; i < n; i++) {
      const [gone] = this.grid.splice(this.top, 1);
      if (!this.alt && this.top === 0) {
        this.scrollback.push(gone.join("").trimEnd());
        if (this.scrollback.length > KEEP) this.scrollback.shift();
      }
      this.grid.splice(this.bottom, 0, this.blank());
    }
  }

  scrollDown(n) {
    for (let i = 0; i < n; i++) {
      this.grid.splice(this.bottom, 1);
      this.grid.splice(this.top, 0, this.blank());
    }
  }

  // The sequence at s[i] (ESC): the index of its last character, or -1 if incomplete.
  escape(s, i) {
    const next = s[i + 1];
    if (next === undefined) return -1;
    if (next === "[") {
      let j = i + 2;
      while (j < s.length && !(s[j] >= "@" && s[j] <= "~")) j++;
      if (j >= s.length) return -1;
      this.csi(s.slice(i + 2, j), s[j]);
      return j;
    }
    if (next === "]" || next === "P" || next === "_") {  // OSC / DCS / APC: to BEL or ST
      for (let j = i + 2; j < s.length; j++) {
        if (s[j] === "\x07") return j;
        if (s[j] === "\x1b" && s[j + 1] === "\\") return j + 1;
      }
      return -1;
    }
    if ("()*+#%".includes(next)) return i + 2 < s.length ? i + 2 : -1;  // charsets: dropped
    if (next === "7") this.saved = { r: this.r, c: this.c };
    else if (next === "8") ({ r: this.r, c: this.c } = this.saved);
    else if (next === "D") this.lineFeed();
    else if (next === "E") { this.c = 0; this.lineFeed(); }
    else if (next === "M") {
      if (this.r === this.top) this.scrollDown(1);
      else this.r = Math.max(0, this.r - 1);
    } else if (next === "c") { this.resize(this.rows, this.cols); this.clearAll(); }
    return i + 1;
  }

  clearAll() {
    this.grid = Array.from({ length: this.rows }, () => this.blank());
    this.r = this.c = 0;
  }

  csi(body, final) {
    const priv = body.startsWith("?");
    const args = (priv ? body.slice(1) : body).split(";").map((a) => parseInt(a, 10));
    const n = (k = 0, dflt = 1) => (Number.isNaN(args[k]) || args[k] === undefined || args[k] === 0
      ? dflt : args[k]);
    const row = this.grid[this.r];
    this.wrapNext = false;
    switch (final) {
      case "A": this.r = Math.max(this.r < this.top ? 0 : this.top, this.r - n()); break;
      case "B": this.r = Math.min(this.r > this.bottom ? this.rows - 1 : this.bottom, this.r + n()); break;
      case "C": this.c = Math.min(this.cols - 1, this.c + n()); break;
      case "D": this.c = Math.max(0, this.c - n()); break;
      case "E": this.r = Math.min(this.rows - 1, this.r + n()); this.c = 0; break;
      case "F": this.r = Math.max(0, this.r - n()); this.c = 0; break;
      case "G": case "`": this.c = Math.min(this.cols - 1, n() - 1); break;
      case "d": this.r = Math.min(this.rows - 1, n() - 1); break;
      case "H": case "f":
        this.r = Math.min(this.rows - 1, n(0) - 1);
        this.c = Math.min(this.cols - 1, n(1) - 1);
        break;
      case "J": this.eraseDisplay(args[0] || 0); break;
      case "K": {
        const mode = args[0] || 0;
        const [a, b] = mode === 0 ? [this.c, this.cols] : mode === 1 ? [0, this.c + 1] : [0, this.cols];
        row.fill(" ", a, b);
        break;
      }
      case "X": row.fill(" ", this.c, Math.min(this.cols, this.c + n())); break;
      case "P": row.splice(this.c, n()); this.grid[this.r] = this.fit(row); break;
      case "@": row.splice(this.c, 0, ...Array(n()).fill(" ")); this.grid[this.r] = this.fit(row); break;
      case "L": case "M": {
        if (this.r < this.top || this.r > this.bottom) break;
        const top = this.top;
        this.top = this.r;
        if (final === "L") this.scrollDown(n()); else this.scrollUp(n());
        this.top = top;
        break;
      }
      case "S": this.scrollUp(n()); break;
      case "T": this.scrollDown(n()); break;
      case "r":
        this.top = Math.min(this.rows - 1, n(0) - 1);
        this.bottom = Math.min(this.rows - 1, n(1, this.rows) - 1);
        if (this.top >= this.bottom) { this.top = 0; this.bottom = this.rows - 1; }
        this.r = this.c = 0;
        break;
      case "s": this.saved = { r: this.r, c: this.c }; break;
      case "u": ({ r: this.r, c: this.c } = this.saved); break;
      case "h": case "l":
        if (priv && [47, 1047, 1049].some((m) => args.includes(m))) this.altScreen(final === "h");
        break;
      default: break;  // m (colours), n (reports), and the rest: dropped
    }
  }

  eraseDisplay(mode) {
    if (mode === 0) {
      this.grid[this.r].fill(" ", this.c);
      for (let r = this.r + 1; r < this.rows; r++) this.grid[r] = this.blank();
    } else if (mode === 1) {
      this.grid[this.r].fill(" ", 0, this.c + 1);
      for (let r = 0; r < this.r; r++) this.grid[r] = this.blank();
    } else {
      if (mode === 3) this.scrollback = [];
      for (let r = 0; r < this.rows; r++) this.grid[r] = this.blank();
    }
  }

  altScreen(on) {
    if (on && !this.alt) {
      this.alt = { grid: this.grid, r: this.r, c: this.c };
      this.clearAll();
    } else if (!on && this.alt) {
      ({ grid: this.grid, r: this.r, c: this.c } = this.alt);
      this.grid = this.grid.map((line) => this.fit(line));
      this.alt = null;
    }
    this.top = 0;
    this.bottom = this.rows - 1;
  }

  // The text shown: scrollback (main screen only) and the grid, trailing blanks trimmed.
  lines() {
    let last = this.rows - 1;
    while (last > this.r && this.grid[last].every((ch) => ch === " ")) last--;
    const screen = this.grid.slice(0, last + 1).map((line) => line.join("").trimEnd());
    return this.alt ? screen : [...this.scrollback, ...screen];
  }

  // Render into a <pre>: text nodes and one <span class="cursor"> (never HTML parsing).
  render(pre) {
    const lines = this.lines();
    const at = (this.alt ? 0 : this.scrollback.length) + this.r;  // the cursor's line
    const before = lines.slice(0, at).join("\n") + (at > 0 ? "\n" : "");
    const line = (lines[at] || "").padEnd(this.c + 1);
    const cursor = document.createElement("span");
    cursor.className = "cursor";
    cursor.textContent = line[this.c];
    const after = line.slice(this.c + 1) + (at < lines.length - 1 ? "\n" : "")
      + lines.slice(at + 1).join("\n");
    pre.replaceChildren(before + line.slice(0, this.c), cursor, after);
    pre.scrollTop = pre.scrollHeight;
  }
}
