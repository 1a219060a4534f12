/**
 * What each API operation sends, as data (no I/O): one function per endpoint. The classes
 * build their requests here and send them through `transport.ts`.
 */

import { posix } from "node:path";

import { InvalidArgumentError } from "./errors.js";
import type { Body, Call } from "./transport.js";

/** Relative sandbox paths are taken from here (the guest's $HOME and exec cwd). */
export const HOME = "/root";
/** `sandbox.upload` takes relative paths from here, `sandbox.download` from `OUTPUT_DIR` (where
 * `result.files` are); the file API (`sandbox.files`) from `HOME`. */
export const INPUT_DIR = "/input";
export const OUTPUT_DIR = "/output";
/** Seconds added to a server-side limit for the HTTP exchange itself. */
export const MARGIN = 90;
export const DEFAULT_EXEC_TIMEOUT = 60;
export const DEFAULT_RUN_TIMEOUT = 300;
/** Seconds: a snapshot or fork copies the VM's memory and disk. */
export const SNAPSHOT_TIMEOUT = 600;

/** An egress policy to set: all closed, all open, or rules (docs/api.md, "Egress policy"). */
export type Egress = "deny_all" | "allow_all" | {
  /** What neither list names gets this (the server's default: "deny"). */
  default?: "deny" | "allow" | undefined;
  /** CIDRs or addresses (IPv4/IPv6) and domain names (`pypi.org`, `*.pypi.org`); at most 64. */
  allow?: string[] | undefined;
  /** As `allow`; deny wins over allow. */
  deny?: string[] | undefined;
};

/** Our HTTP limit for a run the server limits to `timeout` seconds (a bad value: the server says so). */
const limit = (timeout: unknown, fallback: number): number =>
  (typeof timeout === "number" && Number.isFinite(timeout) && timeout >= 0 ? timeout : fallback) + MARGIN;

/** An absolute guest path (relative ones are relative to /root). */
export function sandboxPath(path: string): string {
  if (typeof path !== "string" || !path) {
    throw new InvalidArgumentError("a sandbox path is required", { code: "invalid_path" });
  }
  return path.startsWith("/") ? path : posix.join(HOME, path);
}

/** `path` if absolute, else `directory/path` (sandbox.upload / download). */
export function under(directory: string, path: string): string {
  if (typeof path !== "string" || !path) {
    throw new InvalidArgumentError("a sandbox path is required", { code: "invalid_path" });
  }
  return path.startsWith("/") ? path : posix.join(directory, path);
}

/** A guest path as a URL path (each segment percent-encoded, slashes kept). */
function urlPath(path: string): string {
  return sandboxPath(path).split("/").map(encodeURIComponent).join("/");
}

const sb = (id: string, rest = ""): string => `/v1/sandboxes/${encodeURIComponent(id)}${rest}`;
const pidPath = (id: string, pid: number, rest = ""): string => sb(id, `/commands/${Math.trunc(pid)}${rest}`);

/** The object without its undefined fields (the server applies its defaults to those). */
export function defined(fields: Record<string, unknown>): Record<string, unknown> {
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined && v !== null));
}

function ports(value: unknown): number[] {
  if (!Array.isArray(value) || !value.every((p) => Number.isInteger(p))) {
    throw new InvalidArgumentError(`publicPorts must be an array of port numbers, not ${JSON.stringify(value)}`);
  }
  return [...value];
}

// -- sandboxes ------------------------------------------------------------------------------

export const createSandbox = (template: string | undefined, idleTimeout: number | undefined,
                              metadata: Record<string, unknown> | undefined, ttl?: number,
                              autoDeleteAfter?: number,
                              shape: Record<string, number | undefined> = {}, egress?: Egress): Call =>
  ({ method: "POST", path: "/v1/sandboxes",
     json: defined({ template, idle_timeout: idleTimeout, metadata, ttl, auto_delete_after: autoDeleteAfter,
                     egress, ...shape }) });

/** Filters of `GET /v1/sandboxes` (all must match). */
export interface ListFilters {
  /** One state or several. */
  state?: string | string[] | undefined;
  template?: string | undefined;
  /** Values the sandboxes' metadata must have (a non-string matches its JSON text). */
  metadata?: Record<string, unknown> | undefined;
}

export function listSandboxes(filters: ListFilters = {}, limit?: number, cursor?: string): Call {
  const params: Record<string, string> = {};
  const state = Array.isArray(filters.state) ? filters.state.join(",") : filters.state;
  if (state) params.state = state;
  if (filters.template !== undefined) params.template = filters.template;
  for (const [key, value] of Object.entries(filters.metadata ?? {})) {
    params[`metadata.${key}`] = typeof value === "string" ? value : JSON.stringify(value);
  }
  if (limit !== undefined) params.limit = String(Math.trunc(limit));
  if (cursor !== undefined) params.cursor = cursor;
  return { method: "GET", path: "/v1/sandboxes", params: Object.keys(params).length ? params : undefined };
}

export function usage(from?: number, to?: number, key?: string): Call {
  const params: Record<string, string> = {};
  if (from !== undefined) params.from = String(from);
  if (to !== undefined) params.to = String(to);
  if (key !== undefined) params.key = key;
  return { method: "GET", path: "/v1/usage", params: Object.keys(params).length ? params : undefined };
}
export const sandboxMetrics = (id: string): Call => ({ method: "GET", path: sb(id, "/metrics") });
export const sandboxLogs = (id: string, tail?: number): Call =>
  ({ method: "GET", path: sb(id, "/logs"), params: tail === undefined ? undefined : { tail: String(Math.trunc(tail)) } });
export const getSandbox = (id: string): Call => ({ method: "GET", path: sb(id) });
export const deleteSandbox = (id: string): Call => ({ method: "DELETE", path: sb(id) });
export const suspendSandbox = (id: string): Call => ({ method: "POST", path: sb(id, "/suspend") });
export const resumeSandbox = (id: string): Call => ({ method: "POST", path: sb(id, "/resume") });
export const templates = (): Call => ({ method: "GET", path: "/v1/templates" });
export const serverInfo = (): Call => ({ method: "GET", path: "/v1/info" });

export function updateSandbox(id: string, idleTimeout?: number, metadata?: Record<string, unknown>,
                              publicPorts?: number[], ttl?: number, autoDeleteAfter?: number,
                              egress?: Egress): Call {
  const json = defined({
    idle_timeout: idleTimeout, metadata,
    public_ports: publicPorts === undefined ? undefined : ports(publicPorts),
    ttl, auto_delete_after: autoDeleteAfter, egress,
  });
  if (!Object.keys(json).length) {
    throw new InvalidArgumentError(
      "nothing to update: give idleTimeout, metadata, publicPorts, ttl, autoDeleteAfter and/or egress");
  }
  return { method: "PATCH", path: sb(id), json };
}

// -- templates, snapshots, forks and Dockerfile builds ----------------------------------------

const tpl = (name: string): string => {
  if (typeof name !== "string" || !name) {
    throw new InvalidArgumentError("a template name is required", { code: "bad_template_name" });
  }
  return `/v1/templates/${encodeURIComponent(name)}`;
};
const build = (id: string, rest = ""): string => `/v1/templates/builds/${encodeURIComponent(id)}${rest}`;

export const getTemplate = (name: string): Call => ({ method: "GET", path: tpl(name) });
export const deleteTemplate = (name: string): Call => ({ method: "DELETE", path: tpl(name) });
export const snapshotSandbox = (id: string, template: string): Call =>
  ({ method: "POST", path: sb(id, "/snapshot"), json: { template }, timeout: SNAPSHOT_TIMEOUT });

export function forkSandbox(id: string, count: number): Call {
  if (!Number.isInteger(count) || count < 1) {
    throw new InvalidArgumentError(`a fork makes 1 or more sandboxes, not ${String(count)}`);
  }
  return { method: "POST", path: sb(id, "/fork"), json: { count }, timeout: SNAPSHOT_TIMEOUT };
}

/** `contextTar`: the build context as a tar holding the Dockerfile at `dockerfile`. */
export const startBuild = (name: string, dockerfile: string, contextTar: Uint8Array): Call => ({
  method: "POST", path: "/v1/templates/builds", params: { name, dockerfile }, body: contextTar,
  headers: { "Content-Type": "application/x-tar" },
});
export const getBuild = (id: string): Call => ({ method: "GET", path: build(id) });
/** Followed until the build ends: no limit of ours on it. */
export const buildLog = (id: string): Call => ({ method: "GET", path: build(id, "/log"), timeout: null });

// -- preview access and sessions ------------------------------------------------------------

export const getPreview = (id: string): Call => ({ method: "GET", path: sb(id, "/preview") });
export const setPublicPorts = (id: string, list: number[]): Call =>
  ({ method: "PATCH", path: sb(id, "/preview"), json: { public_ports: ports(list) } });
export const rotatePreviewToken = (id: string): Call => ({ method: "POST", path: sb(id, "/preview-token") });

function session(name: string): string {
  if (typeof name !== "string" || !name) {
    throw new InvalidArgumentError("a session name is required", { code: "bad_session_name" });
  }
  return `/v1/sessions/${encodeURIComponent(name)}`;
}

export interface SessionSpec {
  /** Default: the server's default template. */
  template?: string | undefined;
  /** The app's port (server default 8000). */
  port?: number | undefined;
  idleTimeout?: number | undefined;
  /** Shell command run once, in the background, in the session's new sandbox. */
  start?: string | undefined;
  metadata?: Record<string, unknown> | undefined;
}

export const putSession = (name: string, spec: SessionSpec): Call => ({
  method: "PUT", path: session(name),
  json: defined({ template: spec.template, port: spec.port, idle_timeout: spec.idleTimeout,
                  start: spec.start, metadata: spec.metadata }),
});
export const getSession = (name: string): Call => ({ method: "GET", path: session(name) });
export const listSessions = (): Call => ({ method: "GET", path: "/v1/sessions" });
export const deleteSession = (name: string): Call => ({ method: "DELETE", path: session(name) });

// -- execute and files ------------------------------------------------------------------------

export interface ExecBody {
  code?: string | undefined;
  command?: string | undefined;
  language?: string | undefined;
  timeout?: number | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
}

export function execute(id: string, b: ExecBody): Call {
  if ((b.code === undefined) === (b.command === undefined)) {
    throw new InvalidArgumentError("give exactly one of code or command");
  }
  const json = b.code !== undefined
    ? { code: b.code, language: b.language ?? "python" } : { command: b.command };
  const extra = defined({ timeout: b.timeout, env: b.env,
                          cwd: b.cwd === undefined ? undefined : sandboxPath(b.cwd) });
  return { method: "POST", path: sb(id, "/execute"), json: { ...json, ...extra },
           timeout: limit(b.timeout, DEFAULT_EXEC_TIMEOUT) };
}

export const writeFile = (id: string, path: string, body: Body, size?: number): Call => ({
  method: "POST", path: sb(id, "/files"), params: { path: sandboxPath(path) }, body, timeout: null,
  headers: { "Content-Type": "application/octet-stream",
             ...(size === undefined ? {} : { "Content-Length": String(size) }) },
});
export const readFile = (id: string, path: string): Call =>
  ({ method: "GET", path: sb(id, `/files${urlPath(path)}`), timeout: null });
export const statFile = (id: string, path: string): Call =>
  ({ method: "GET", path: sb(id, `/stat${urlPath(path)}`) });
export const deleteFile = (id: string, path: string): Call =>
  ({ method: "DELETE", path: sb(id, `/files${urlPath(path)}`) });

// -- code interpreter -----------------------------------------------------------------------

export interface RunBody {
  code: string;
  language: string;
  context?: string | undefined;
  timeout?: number | undefined;
  env?: Record<string, string> | undefined;
  stream: boolean;
}

export const runCode = (id: string, b: RunBody): Call => ({
  method: "POST", path: sb(id, "/run_code"),
  json: { code: b.code, language: b.language, stream: b.stream,
          ...defined({ context: b.context, timeout: b.timeout, env: b.env }) },
  timeout: limit(b.timeout, DEFAULT_RUN_TIMEOUT),
});
export const createContext = (id: string, name?: string, cwd?: string, env?: Record<string, string>): Call =>
  ({ method: "POST", path: sb(id, "/contexts"), json: defined({ name, cwd, env }) });
export const listContexts = (id: string): Call => ({ method: "GET", path: sb(id, "/contexts") });
export const deleteContext = (id: string, name: string): Call =>
  ({ method: "DELETE", path: sb(id, `/contexts/${encodeURIComponent(name)}`) });

// -- commands -------------------------------------------------------------------------------

export interface CommandBody {
  command: string;
  background: boolean;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
  stdin: boolean;
  timeout?: number | undefined;
}

export const startCommand = (id: string, b: CommandBody): Call => ({
  method: "POST", path: sb(id, "/commands"),
  json: { command: b.command, background: b.background, stdin: b.stdin,
          ...defined({ env: b.env, cwd: b.cwd === undefined ? undefined : sandboxPath(b.cwd),
                       timeout: b.timeout }) },
  // A silent foreground run may be long: no limit of ours on it.
  timeout: b.background ? DEFAULT_EXEC_TIMEOUT : null,
});
export const listCommands = (id: string): Call => ({ method: "GET", path: sb(id, "/commands") });
export const getCommand = (id: string, pid: number): Call => ({ method: "GET", path: pidPath(id, pid) });
export const commandStdin = (id: string, pid: number, data: Uint8Array, eof: boolean): Call => ({
  method: "POST", path: pidPath(id, pid, "/stdin"), body: data,
  params: eof ? { eof: "1" } : undefined, headers: { "Content-Type": "application/octet-stream" },
});
export const signalCommand = (id: string, pid: number, signal: string | number): Call =>
  ({ method: "POST", path: pidPath(id, pid, "/signal"), json: { signal } });
export const waitCommand = (id: string, pid: number, timeout: number): Call =>
  ({ method: "GET", path: pidPath(id, pid, "/wait"), params: { timeout: String(timeout) },
     timeout: limit(timeout, 30) });
export const commandOutput = (id: string, pid: number, offset: number, follow: boolean): Call => ({
  method: "GET", path: pidPath(id, pid, "/output"),
  params: { offset: String(offset), ...(follow ? { follow: "1" } : {}) }, timeout: null,
});

export function toBytes(data: string | Uint8Array): Uint8Array {
  return typeof data === "string" ? new TextEncoder().encode(data) : data;
}
