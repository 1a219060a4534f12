/**
 * A Dockerfile build's context as a tar, the way the Python SDK packs it: every file and
 * symlink under the directory (not followed), skipping VCS/cache directories and what
 * `.dockerignore` names (simple patterns, as Python's fnmatch), plus the Dockerfile under a
 * name of its own when it lives outside the context. {@link tarArchive} is the format alone
 * (ustar, with a PAX header for a name that does not fit); {@link packContext} reads the disk.
 */

import { lstat, readFile, readdir, readlink } from "node:fs/promises";
import { join, relative, resolve, sep } from "node:path";

import { InvalidArgumentError } from "./errors.js";

export const ALWAYS_SKIPPED: readonly string[] = [".git", "__pycache__", ".venv", "node_modules"];
/** The server's default `[build] max_context_bytes`. */
export const MAX_CONTEXT_BYTES = 64 * 1024 * 1024;
/** The Dockerfile's name in the tar when it lives outside the context directory. */
export const OUTSIDE_DOCKERFILE = ".agentbox.Dockerfile";

export interface TarEntry {
  /** A relative POSIX path. */
  name: string;
  data?: Uint8Array | undefined;
  /** Permission bits (default 0o644). */
  mode?: number | undefined;
  /** Unix seconds (default 0). */
  mtime?: number | undefined;
  /** Makes the entry a symlink to this target (no data). */
  linkTo?: string | undefined;
}

const BLOCK = 512;
const encoder = new TextEncoder();

function put(header: Uint8Array, offset: number, size: number, text: string): void {
  const bytes = encoder.encode(text);
  if (bytes.length > size) throw new InvalidArgumentError(`tar field too long: ${text.slice(0, 40)}`);
  header.set(bytes, offset);
}

const octal = (value: number, size: number): string => `${Math.trunc(value).toString(8).padStart(size - 1, "0")}\0`;

/** A PAX record: "LEN key=value\n", LEN counting itself. */
function paxRecord(key: string, value: string): string {
  const body = ` ${key}=${value}\n`;
  const bodyLen = encoder.encode(body).length;
  let len = bodyLen + 1;
  while (String(len).length + bodyLen !== len) len = String(len).length + bodyLen;
  return `${len}${body}`;
}

function header(name: string, size: number, type: string, mode: number, mtime: number, link = ""): Uint8Array {
  const h = new Uint8Array(BLOCK);
  put(h, 0, 100, name);
  put(h, 100, 8, octal(mode & 0o7777, 8));
  put(h, 108, 8, octal(0, 8));
  put(h, 116, 8, octal(0, 8));
  put(h, 124, 12, octal(size, 12));
  put(h, 136, 12, octal(mtime, 12));
  put(h, 148, 8, "        "); // the checksum counts its own field as spaces
  put(h, 156, 1, type);
  put(h, 157, 100, link);
  put(h, 257, 8, "ustar\u000000");
  let sum = 0;
  for (const byte of h) sum += byte;
  put(h, 148, 8, `${sum.toString(8).padStart(6, "0")}\0 `);
  return h;
}

const fits = (text: string): boolean => encoder.encode(text).length <= 100 && /^[\x20-\x7e]*$/.test(text);

function padded(data: Uint8Array): Uint8Array[] {
  const rest = data.length % BLOCK;
  return rest ? [data, new Uint8Array(BLOCK - rest)] : [data];
}

/** The entries as one tar (uncompressed), ending in its two zero blocks. */
export function tarArchive(entries: readonly TarEntry[]): Uint8Array {
  const parts: Uint8Array[] = [];
  for (const e of entries) {
    const data = e.linkTo === undefined ? e.data ?? new Uint8Array(0) : new Uint8Array(0);
    const link = e.linkTo ?? "";
    const mode = e.mode ?? 0o644;
    const mtime = e.mtime ?? 0;
    if (!fits(e.name) || !fits(link)) {
      const pax = encoder.encode(paxRecord("path", e.name) + (link ? paxRecord("linkpath", link) : ""));
      parts.push(header("././@PaxHeader", pax.length, "x", 0o644, mtime), ...padded(pax));
    }
    const short = (s: string): string => (fits(s) ? s : s.replace(/[^\x20-\x7e]/g, "_").slice(-100));
    parts.push(header(short(e.name), data.length, e.linkTo === undefined ? "0" : "2", mode, mtime, short(link)));
    if (data.length) parts.push(...padded(data));
  }
  parts.push(new Uint8Array(2 * BLOCK));
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** Python's fnmatch.translate for `*`, `?`, `[seq]` and `[!seq]` (`*` crosses `/`). */
export function globRegExp(pattern: string): RegExp {
  let re = "";
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i]!;
    if (c === "*") re += ".*";
    else if (c === "?") re += ".";
    else if (c === "[" && pattern.indexOf("]", i + 2) > i) {
      const end = pattern.indexOf("]", i + 2);
      let body = pattern.slice(i + 1, end).replace(/\\/g, "\\\\");
      if (body.startsWith("!")) body = `^${body.slice(1)}`;
      re += `[${body}]`;
      i = end;
    } else re += c.replace(/[.+^${}()|[\]\\]/g, "\\$&");
  }
  return new RegExp(`^${re}$`, "s");
}

/** The `.dockerignore` patterns (comments and blank lines dropped, trailing `/` removed). */
export function ignorePatterns(text: string): string[] {
  return text.split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"))
    .map((l) => l.replace(/\/+$/, ""));
}

/** Whether a relative path is left out of the context. */
export function skipped(rel: string, patterns: readonly string[]): boolean {
  if (rel.split("/").some((part) => ALWAYS_SKIPPED.includes(part))) return true;
  return patterns.some((p) => globRegExp(p).test(rel) || rel.startsWith(`${p}/`));
}

async function walk(root: string, dir = ""): Promise<string[]> {
  const out: string[] = [];
  const names = (await readdir(join(root, dir))).sort();
  for (const name of names) {
    const rel = dir ? `${dir}/${name}` : name;
    const info = await lstat(join(root, rel));
    out.push(rel);
    if (info.isDirectory()) out.push(...await walk(root, rel));
  }
  return out;
}

async function entryOf(root: string, rel: string, name = rel): Promise<TarEntry | undefined> {
  const path = join(root, rel);
  const info = await lstat(path);
  const mtime = Math.floor(info.mtimeMs / 1000);
  if (info.isSymbolicLink()) return { name, linkTo: await readlink(path), mode: 0o777, mtime };
  if (!info.isFile()) return undefined;
  return { name, data: await readFile(path), mode: info.mode, mtime };
}

function checkSize(tar: Uint8Array): Uint8Array {
  if (tar.length > MAX_CONTEXT_BYTES) {
    throw new InvalidArgumentError(`the build context is larger than ${MAX_CONTEXT_BYTES} bytes (add a .dockerignore)`);
  }
  return tar;
}

/** In-memory files (name -> text or bytes) as a context tar. */
export function packFiles(files: Record<string, string | Uint8Array>): Uint8Array {
  return checkSize(tarArchive(Object.entries(files).map(([name, data]) =>
    ({ name, data: typeof data === "string" ? encoder.encode(data) : data }))));
}

/**
 * The directory `context` as a tar, and the Dockerfile's path inside it (`dockerfile`, a
 * local path, default `CONTEXT/Dockerfile`; outside the context it is added as
 * {@link OUTSIDE_DOCKERFILE}).
 */
export async function packContext(context: string, dockerfile?: string): Promise<{ tar: Uint8Array; dockerfile: string }> {
  const root = resolve(context);
  if (!(await lstat(root).catch(() => undefined))?.isDirectory()) {
    throw new InvalidArgumentError(`build context ${context} is not a directory`);
  }
  const ignore = await readFile(join(root, ".dockerignore"), "utf8").then(ignorePatterns, () => []);
  const entries: TarEntry[] = [];
  for (const rel of await walk(root)) {
    if (skipped(rel, ignore)) continue;
    const entry = await entryOf(root, rel);
    if (entry) entries.push(entry);
  }
  let name = "Dockerfile";
  if (dockerfile !== undefined) {
    const inside = relative(root, resolve(dockerfile));
    if (inside && !inside.startsWith("..") && !inside.startsWith(sep)) {
      name = inside.split(sep).join("/");
    } else {
      const [dir, base] = [resolve(dockerfile, ".."), resolve(dockerfile).split(sep).pop()!];
      const entry = await entryOf(dir, base, OUTSIDE_DOCKERFILE);
      if (!entry) throw new InvalidArgumentError(`the Dockerfile ${dockerfile} is not a file`);
      entries.push(entry);
      name = OUTSIDE_DOCKERFILE;
    }
  }
  return { tar: checkSize(tarArchive(entries)), dockerfile: name };
}
