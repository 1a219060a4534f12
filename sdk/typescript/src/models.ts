/**
 * The SDK's value types: what the API answers, parsed from its snake_case JSON into camelCase
 * objects. Parsing tolerates extra fields (a newer server may add some) and is strict about the
 * ones we read: a missing one throws {@link ProtocolError}.
 */

import { ProtocolError } from "./errors.js";

type Json = Record<string, unknown>;

function obj(data: unknown, kind: string): Json {
  if (typeof data !== "object" || data === null || Array.isArray(data)) {
    throw new ProtocolError(`${kind}: expected a JSON object from the server`);
  }
  return data as Json;
}

function need(data: Json, name: string, kind: string): unknown {
  if (!(name in data)) throw new ProtocolError(`${kind}: the server's answer has no '${name}' field`);
  return data[name];
}

const str = (v: unknown, fallback = ""): string => (v === undefined || v === null ? fallback : String(v));
const num = (v: unknown): number | undefined => (typeof v === "number" ? v : undefined);
const numOrNull = (v: unknown): number | null => (typeof v === "number" ? v : null);
const strOrNull = (v: unknown): string | null => (typeof v === "string" ? v : null);

/** creating, running, paused, suspending, suspended, restoring, failed, destroyed. */
export type SandboxState = "creating" | "running" | "paused" | "suspending" | "suspended"
  | "restoring"
  | "failed" | "destroyed" | (string & {});

export interface SandboxInfo {
  id: string;
  /** E2B's name for `id`. */
  sandboxId: string;
  state: SandboxState;
  template: string;
  metadata: Record<string, unknown>;
  idleTimeout: number | null;
  createdAt: number | undefined;
  updatedAt: number | undefined;
  lastActivity: number | undefined;
  suspendCount: number;
  restoreCount: number;
  lastSuspendMs: number | null;
  lastRestoreMs: number | null;
  /** Why the sandbox is `failed` (until its next request cold-boots it). */
  failure: string | null;
  /** Only from get/update (the owner's view), not from list. */
  previewToken: string | null;
  publicPorts: number[];
  previewUrlTemplate: string | null;
  /** Unix time its ttl ends (null: no ttl). */
  expiresAt: number | null;
  /** Seconds suspended (or failed) before it is deleted (0 = never). */
  autoDeleteAfter: number;
  /** While asleep: when `autoDeleteAfter` ends. */
  deleteAt: number | null;
  /** Its shape (null: a sandbox made before shapes). */
  vcpus: number | null;
  memoryMib: number | null;
  diskMib: number | null;
  /** Its egress policy (null: a server without policies). */
  egress: EgressPolicy | null;
}

/** A sandbox's egress policy as the server applies it (docs/api.md, "Egress policy"). */
export interface EgressPolicy {
  /** What neither list names gets. */
  default: "deny" | "allow" | (string & {});
  allow: string[];
  deny: string[];
  /** "sandbox": its own policy; "host": it follows the host's default. */
  source: "sandbox" | "host" | (string & {});
}

const strings = (v: unknown): string[] => (Array.isArray(v) ? v.map((x) => str(x)) : []);

export function parseEgress(data: unknown): EgressPolicy | null {
  if (data === undefined || data === null) return null;
  const d = obj(data, "egress");
  return { default: str(d.default, "deny"), allow: strings(d.allow), deny: strings(d.deny),
           source: str(need(d, "source", "egress")) };
}

export function parseSandbox(data: unknown): SandboxInfo {
  const d = obj(data, "sandbox");
  const id = str(need(d, "id", "sandbox"));
  return {
    id, sandboxId: id, state: str(need(d, "state", "sandbox")),
    template: str(need(d, "template", "sandbox")),
    metadata: (d.metadata as Record<string, unknown> | undefined) ?? {},
    idleTimeout: numOrNull(d.idle_timeout), createdAt: num(d.created_at),
    updatedAt: num(d.updated_at), lastActivity: num(d.last_activity),
    suspendCount: num(d.suspend_count) ?? 0, restoreCount: num(d.restore_count) ?? 0,
    lastSuspendMs: numOrNull(d.last_suspend_ms), lastRestoreMs: numOrNull(d.last_restore_ms),
    failure: strOrNull(d.failure), previewToken: strOrNull(d.preview_token),
    publicPorts: Array.isArray(d.public_ports) ? d.public_ports.map(Number) : [],
    previewUrlTemplate: strOrNull(d.preview_url_template),
    expiresAt: numOrNull(d.expires_at), autoDeleteAfter: num(d.auto_delete_after) ?? 0,
    deleteAt: numOrNull(d.delete_at),
    vcpus: numOrNull(d.vcpus), memoryMib: numOrNull(d.memory_mib), diskMib: numOrNull(d.disk_mib),
    egress: parseEgress(d.egress),
  };
}

/** One page of `GET /v1/sandboxes`; `nextCursor` is null on the last page. `partial` (a
 * fleet of hosts only): the hosts that did not answer in time, whose sandboxes are missing
 * from this page; empty when the listing is whole. */
export interface SandboxPage {
  sandboxes: SandboxInfo[];
  nextCursor: string | null;
  partial: string[];
}

export function parseSandboxPage(data: unknown): SandboxPage {
  const d = obj(data, "sandbox list");
  const items = need(d, "sandboxes", "sandbox list");
  return { sandboxes: (Array.isArray(items) ? items : []).map(parseSandbox),
           nextCursor: strOrNull(d.next_cursor),
           partial: Array.isArray(d.partial) ? d.partial.map(String) : [] };
}

/** Metered use of a sandbox (or, with `sandboxes`, of a key) in a window. */
export interface UsageFigures {
  awakeSeconds: number;
  vcpuSeconds: number;
  gibSeconds: number;
  suspendedSeconds: number;
  snapshotGibHours: number;
  restores: number;
  created: number;
  destroyed: number;
}

export interface SandboxUsage extends UsageFigures { sandboxId: string; key: string }
export interface KeyUsage extends UsageFigures { key: string; sandboxes: SandboxUsage[] }
export interface Usage { from: number; to: number; keys: KeyUsage[] }

function figures(d: Json): UsageFigures {
  return {
    awakeSeconds: num(d.awake_seconds) ?? 0, vcpuSeconds: num(d.vcpu_seconds) ?? 0,
    gibSeconds: num(d.gib_seconds) ?? 0, suspendedSeconds: num(d.suspended_seconds) ?? 0,
    snapshotGibHours: num(d.snapshot_gib_hours) ?? 0, restores: num(d.restores) ?? 0,
    created: num(d.created) ?? 0, destroyed: num(d.destroyed) ?? 0,
  };
}

function parseSandboxUsage(data: unknown): SandboxUsage {
  const d = obj(data, "usage");
  return { sandboxId: str(need(d, "sandbox_id", "usage")), key: str(d.key), ...figures(d) };
}

function parseKeyUsage(data: unknown): KeyUsage {
  const d = obj(data, "usage");
  const items = Array.isArray(d.sandboxes) ? d.sandboxes : [];
  return { key: str(need(d, "key", "usage")), ...figures(d), sandboxes: items.map(parseSandboxUsage) };
}

export function parseUsage(data: unknown): Usage {
  const d = obj(data, "usage");
  return { from: num(need(d, "from", "usage")) ?? 0, to: num(need(d, "to", "usage")) ?? 0,
           keys: (Array.isArray(d.keys) ? d.keys : []).map(parseKeyUsage) };
}

/** A sandbox's resource use as the host sees it (its VMM's cgroup or /proc). */
export interface SandboxMetrics {
  sandboxId: string;
  state: SandboxState;
  vmmPid: number | null;
  /** "cgroup", "proc", or null (no VM running). */
  source: string | null;
  cpuSeconds: number | null;
  memoryBytes: number | null;
  rssBytes: number | null;
  diskBytes: number;
  snapshotBytes: number;
  at: number;
}

export function parseMetrics(data: unknown): SandboxMetrics {
  const d = obj(data, "metrics");
  return {
    sandboxId: str(need(d, "sandbox_id", "metrics")), state: str(need(d, "state", "metrics")),
    vmmPid: numOrNull(d.vmm_pid), source: strOrNull(d.source), cpuSeconds: numOrNull(d.cpu_seconds),
    memoryBytes: numOrNull(d.memory_bytes), rssBytes: numOrNull(d.rss_bytes),
    diskBytes: num(need(d, "disk_bytes", "metrics")) ?? 0, snapshotBytes: num(d.snapshot_bytes) ?? 0,
    at: num(need(d, "at", "metrics")) ?? 0,
  };
}

export interface SandboxEvent { at: number; from: string | null; to: string; event: string; cause: string }

/** A sandbox's console log tail (lines) and its state transitions. */
export interface SandboxLogs {
  sandboxId: string;
  console: string[];
  truncated: boolean;
  events: SandboxEvent[];
}

function parseEvent(data: unknown): SandboxEvent {
  const d = obj(data, "event");
  return { at: num(d.at) ?? 0, from: strOrNull(d.from), to: str(d.to), event: str(d.event), cause: str(d.cause) };
}

export function parseLogs(data: unknown): SandboxLogs {
  const d = obj(data, "logs");
  const lines = need(d, "console", "logs");
  const events = need(d, "events", "logs");
  return {
    sandboxId: str(need(d, "sandbox_id", "logs")),
    console: (Array.isArray(lines) ? lines : []).map((l) => str(l)),
    truncated: Boolean(d.truncated),
    events: (Array.isArray(events) ? events : []).map(parseEvent),
  };
}

/** A template: `owner` "builtin" or "tenant" (the key's own: a snapshot, a fork's or a
 * Dockerfile build); `state` ready, building (`progress`), failed (`error`) or deleting. */
export interface Template {
  name: string;
  memMib: number | undefined;
  default: boolean;
  owner: string;
  source: string;
  state: string;
  progress: Record<string, unknown> | null;
  error: string | null;
  createdAt: number | undefined;
  sizeBytes: number;
  fromSandbox: string | null;
  pausedMs: number | null;
  /** Default shape and per-sandbox limits (built-in templates). */
  vcpus: number | undefined;
  diskMib: number | undefined;
  maxVcpus: number | undefined;
  maxMemoryMib: number | undefined;
  maxDiskMib: number | undefined;
}

export function parseTemplate(data: unknown): Template {
  const d = obj(data, "template");
  return {
    name: str(need(d, "name", "template")), memMib: num(d.mem_mib), default: Boolean(d.default),
    owner: str(d.owner ?? "builtin"), source: str(d.source ?? "builtin"), state: str(d.state ?? "ready"),
    progress: (d.progress as Record<string, unknown> | null | undefined) ?? null,
    error: strOrNull(d.error), createdAt: num(d.created_at), sizeBytes: num(d.size_bytes) ?? 0,
    fromSandbox: strOrNull(d.from_sandbox), pausedMs: numOrNull(d.paused_ms),
    vcpus: num(d.vcpus), diskMib: num(d.disk_mib), maxVcpus: num(d.max_vcpus),
    maxMemoryMib: num(d.max_memory_mib), maxDiskMib: num(d.max_disk_mib),
  };
}

/** A build of a template from a Dockerfile: `state` queued, running, ready or failed; `step` of
 * `steps` (`cachedSteps` of them from the cache); `template` (the Template's JSON) once ready,
 * `error` (the step and its exit code) once failed. */
export interface TemplateBuild {
  id: string;
  name: string;
  state: "queued" | "running" | "ready" | "failed" | (string & {});
  steps: number;
  step: number;
  cachedSteps: number;
  error: string | null;
  createdAt: number | undefined;
  finishedAt: number | null;
  template: Template | null;
}

export function parseBuild(data: unknown): TemplateBuild {
  const d = obj(data, "build");
  return {
    id: str(need(d, "id", "build")), name: str(need(d, "name", "build")),
    state: str(need(d, "state", "build")), steps: num(d.steps) ?? 0, step: num(d.step) ?? 0,
    cachedSteps: num(d.cached_steps) ?? 0, error: strOrNull(d.error), createdAt: num(d.created_at),
    finishedAt: numOrNull(d.finished_at),
    // The spec says only "an object": a Template once ready (parsed when it names one).
    template: typeof d.template === "object" && d.template !== null && "name" in d.template
      ? parseTemplate(d.template) : null,
  };
}

/** One line of a build's log: `step` (n, of, text, cached), `output` (n, stream, text),
 * `step_done` (n, seconds), `error` (message, exit_code), `done` (state, template or error). */
export type BuildEvent = { type: "queued" | "step" | "output" | "step_done" | "error" | "done" | (string & {});
                           t?: number } & Record<string, unknown>;

/** A file a run created or changed under `/output/` (download it with `files.read`). */
export interface OutputFile { path: string; size: number }

export function parseOutputFiles(items: unknown): OutputFile[] {
  return (Array.isArray(items) ? items : []).map((f) => {
    const d = obj(f, "output file");
    return { path: str(need(d, "path", "output file")), size: Number(need(d, "size", "output file")) };
  });
}

/** `GET /v1/info`: `previewUrlTemplate` holds `{port}` and `{id}`, `sessionUrlTemplate` `{name}`. */
export interface ServerInfo {
  version: string | undefined;
  previewDomain: string | undefined;
  sessionDomain: string | undefined;
  previewUrlTemplate: string | undefined;
  sessionUrlTemplate: string | undefined;
  /** The key the request was made with (servers since the dashboard name it). */
  key: KeyRef | undefined;
  raw: Json;
}

/** An API key as the server names it: never its secret. */
export interface KeyRef {
  id: string;
  name: string;
  admin: boolean;
}

function parseKeyRef(data: unknown): KeyRef | undefined {
  if (typeof data !== "object" || data === null) return undefined;
  const d = data as Json;
  const id = strOrNull(d.id);
  return id === null ? undefined : { id, name: strOrNull(d.name) ?? "", admin: d.admin === true };
}

export function parseServerInfo(data: unknown): ServerInfo {
  const d = typeof data === "object" && data !== null ? (data as Json) : {};
  return {
    version: strOrNull(d.version) ?? undefined,
    previewDomain: strOrNull(d.preview_domain) ?? undefined,
    sessionDomain: strOrNull(d.session_domain) ?? undefined,
    previewUrlTemplate: strOrNull(d.preview_url_template) ?? undefined,
    sessionUrlTemplate: strOrNull(d.session_url_template) ?? undefined,
    key: parseKeyRef(d.key), raw: d,
  };
}

/** Who may open a sandbox's preview URLs: the token opens every port; public ports need none. */
export interface PreviewAccess {
  previewToken: string;
  publicPorts: number[];
  previewUrlTemplate: string | null;
}

export function parsePreview(data: unknown): PreviewAccess {
  const d = obj(data, "preview");
  return {
    previewToken: str(need(d, "preview_token", "preview")),
    publicPorts: Array.isArray(d.public_ports) ? d.public_ports.map(Number) : [],
    previewUrlTemplate: strOrNull(d.preview_url_template),
  };
}

export interface FileInfo {
  path: string;
  name: string;
  type: "file" | "dir" | "symlink" | "other" | (string & {});
  size: number;
  mode: number;
  mtime: number;
  isDir: boolean;
}

export function parseFileInfo(data: unknown): FileInfo {
  const d = obj(data, "file info");
  const type = str(need(d, "type", "file info"));
  return {
    path: str(need(d, "path", "file info")), name: str(need(d, "name", "file info")), type,
    size: Number(need(d, "size", "file info")), mode: Number(need(d, "mode", "file info")),
    mtime: Number(need(d, "mtime", "file info")), isDir: type === "dir",
  };
}

/** An exception raised by the code that ran. */
export class ExecutionError {
  constructor(readonly name: string, readonly value: string, readonly traceback: string) {}

  static parse(data: unknown): ExecutionError {
    const d = obj(data, "error");
    return new ExecutionError(str(need(d, "name", "error")), str(d.value), str(d.traceback));
  }

  toString(): string {
    return this.value ? `${this.name}: ${this.value}` : this.name;
  }
}

/**
 * One rich result of a run: a MIME bundle (`data`). Getters give each format; `png`/`jpeg`
 * are base64 strings (as E2B). `isMainResult` marks the value of the code's last expression.
 */
export class Result {
  constructor(readonly data: Record<string, unknown>, readonly isMainResult = false) {}

  static parse(raw: unknown): Result {
    const d = obj(raw, "result");
    const { is_main_result: main, ...bundle } = d;
    return new Result(bundle, Boolean(main));
  }

  private fmt(mime: string): string | undefined {
    const value = this.data[mime];
    return value === undefined || value === null ? undefined : String(value);
  }

  get text(): string | undefined { return this.fmt("text/plain"); }
  get html(): string | undefined { return this.fmt("text/html"); }
  get markdown(): string | undefined { return this.fmt("text/markdown"); }
  get svg(): string | undefined { return this.fmt("image/svg+xml"); }
  get png(): string | undefined { return this.fmt("image/png"); }
  get jpeg(): string | undefined { return this.fmt("image/jpeg"); }
  get latex(): string | undefined { return this.fmt("text/latex"); }
  /** application/json, as the value it encodes. */
  get json(): unknown { return this.data["application/json"]; }

  /** The MIME types this result carries. */
  formats(): string[] {
    return Object.keys(this.data);
  }

  /** The decoded PNG (or JPEG) image, if this result is one. */
  imageBytes(): Uint8Array | undefined {
    const b64 = this.png ?? this.jpeg;
    return b64 === undefined ? undefined : new Uint8Array(Buffer.from(b64, "base64"));
  }

  toString(): string {
    return this.text ?? this.formats()[0] ?? "";
  }
}

/** The outcome of `runCode`: output, rich results, and the error if the code raised. */
export class Execution {
  constructor(
    readonly stdout: string,
    readonly stderr: string,
    readonly results: Result[],
    readonly error: ExecutionError | null,
    readonly executionCount: number | undefined,
    readonly durationMs: number | undefined,
    readonly truncated = false,
    /** Files the run created or changed under `/output/`. */
    readonly files: OutputFile[] = [],
  ) {}

  static parse(data: unknown): Execution {
    const d = obj(data, "execution");
    const err = need(d, "error", "execution");
    const results = Array.isArray(d.results) ? d.results.map((r) => Result.parse(r)) : [];
    return new Execution(str(d.stdout), str(d.stderr), results,
      err === null || err === undefined ? null : ExecutionError.parse(err),
      num(d.execution_count), num(d.duration_ms), Boolean(d.truncated), parseOutputFiles(d.files));
  }

  /** text/plain of the main result (the value of the last expression), if any. */
  get text(): string | undefined {
    return this.results.find((r) => r.isMainResult)?.text;
  }

  get logs(): { stdout: string; stderr: string } {
    return { stdout: this.stdout, stderr: this.stderr };
  }
}

// Python's last traceback line: "ZeroDivisionError: division by zero" (dotted names allowed).
const EXC_LINE = /^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|StopIteration))(?::\s?(.*))?$/;

/**
 * The outcome of `execute`: a program or shell command run to completion in a fresh process.
 * `error` is set when it failed: for Python code the exception parsed from the traceback,
 * else `NonZeroExit` or `TimeoutError`.
 */
export class ExecResult {
  constructor(
    readonly stdout: string,
    readonly stderr: string,
    readonly exitCode: number,
    readonly durationMs: number,
    readonly timedOut = false,
    readonly truncated = false,
    readonly language: string | undefined = undefined,
    /** Files the run created or changed under `/output/`. */
    readonly files: OutputFile[] = [],
  ) {}

  static parse(data: unknown, language?: string): ExecResult {
    const d = obj(data, "exec result");
    return new ExecResult(str(need(d, "stdout", "exec result")), str(d.stderr),
      Number(need(d, "exit_code", "exec result")), num(d.duration_ms) ?? 0,
      Boolean(d.timed_out), Boolean(d.truncated), language, parseOutputFiles(d.files));
  }

  get ok(): boolean {
    return this.exitCode === 0 && !this.timedOut;
  }

  get error(): ExecutionError | null {
    if (this.ok) return null;
    if (this.timedOut) return new ExecutionError("TimeoutError", "the run timed out and was killed", this.stderr);
    if (this.language === "python") {
      const lines = this.stderr.trim().split("\n").filter((l) => l.trim());
      const match = lines.length ? EXC_LINE.exec(lines[lines.length - 1]!) : null;
      if (match) return new ExecutionError(match[1]!, match[2] ?? "", this.stderr);
    }
    return new ExecutionError("NonZeroExit", `exit code ${this.exitCode}`, this.stderr);
  }
}

/** A command started with `commands.run` (`exitCode` is -N when killed by signal N). */
export interface ProcessInfo {
  pid: number;
  command: string;
  cwd: string;
  background: boolean;
  /** Its stdin pipe is still open for writing. */
  stdin: boolean;
  running: boolean;
  exitCode: number | null;
  startedAt: number | undefined;
  finishedAt: number | null;
  timedOut: boolean;
  /** Absolute offset of the end of its output so far. */
  outputBytes: number;
}

export function parseProcess(data: unknown): ProcessInfo {
  const d = obj(data, "process");
  return {
    pid: Number(need(d, "pid", "process")), command: str(d.command), cwd: str(d.cwd),
    background: d.background === undefined ? true : Boolean(d.background),
    stdin: Boolean(d.stdin), running: d.running === undefined ? true : Boolean(d.running),
    exitCode: numOrNull(d.exit_code), startedAt: num(d.started_at),
    finishedAt: numOrNull(d.finished_at), timedOut: Boolean(d.timed_out),
    outputBytes: num(d.output_bytes) ?? 0,
  };
}

/** A finished command: its whole output and exit code (a non-zero exit is not an exception). */
export class CommandResult {
  constructor(
    readonly pid: number | undefined,
    readonly stdout: string,
    readonly stderr: string,
    readonly exitCode: number,
    readonly timedOut = false,
  ) {}

  get ok(): boolean {
    return this.exitCode === 0 && !this.timedOut;
  }

  /** E2B's `CommandResult.error`: stderr (or the exit code) when it failed. */
  get error(): string | undefined {
    return this.ok ? undefined : this.stderr || `exit code ${this.exitCode}`;
  }
}

/** A piece of a command's output; `nextOffset` is where to reattach after it. */
export interface OutputChunk {
  stream: "stdout" | "stderr";
  data: string;
  offset: number;
  nextOffset: number;
}

/** A code-interpreter context: its own interpreter process, globals and cwd. */
export interface CodeContext {
  name: string;
  /** Same as `name` (E2B's word). */
  id: string;
  language: string;
  cwd: string;
  pid: number | null;
  running: boolean;
  executionCount: number;
  createdAt: number | undefined;
}

export function parseContext(data: unknown): CodeContext {
  const d = obj(data, "context");
  const name = str(need(d, "name", "context"));
  return {
    name, id: name, language: str(d.language, "python"), cwd: str(d.cwd),
    pid: numOrNull(d.pid), running: Boolean(d.running),
    executionCount: num(d.execution_count) ?? 0, createdAt: num(d.created_at),
  };
}

export type StartState = "none" | "starting" | "started" | "failed" | (string & {});

/** The server's view of a session (see `Session` in sessions.ts for the object you get). */
export interface SessionView {
  name: string;
  sandboxId: string | null;
  state: string;
  port: number;
  url: string | null;
  proxyPath: string | null;
  previewToken: string | null;
  start: string | null;
  startState: StartState;
  startPid: number | null;
  startError: string | null;
  metadata: Record<string, unknown>;
  createdAt: number | undefined;
}

export function parseSessionView(data: unknown): SessionView {
  const d = obj(data, "session");
  return {
    name: str(need(d, "name", "session")), sandboxId: strOrNull(d.sandbox_id),
    state: str(need(d, "state", "session")), port: Number(need(d, "port", "session")),
    url: strOrNull(d.url), proxyPath: strOrNull(d.proxy_path),
    previewToken: strOrNull(d.preview_token), start: strOrNull(d.start),
    startState: str(d.start_state, "none"), startPid: numOrNull(d.start_pid),
    startError: strOrNull(d.start_error),
    metadata: (d.metadata as Record<string, unknown> | undefined) ?? {}, createdAt: num(d.created_at),
  };
}
