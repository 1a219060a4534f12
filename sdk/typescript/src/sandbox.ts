/**
 * `Sandbox`: one microVM sandbox.
 *
 * Made by `Sandbox.create()` / `box.create()` (a new sandbox) or `Sandbox.connect(id)` (an
 * existing one). A sandbox that went to sleep (suspended when idle) needs no special call: the
 * server wakes it for the next request. `await using sandbox = ...` (TypeScript 5.2+) kills it
 * at the end of the block unless it was made with `keep: true` or connected to.
 */

import * as calls from "./calls.js";
import { AgentBox, type CreateOptions } from "./client.js";
import { Commands } from "./commands.js";
import { SandboxNotFoundError } from "./errors.js";
import { Files, type TransferOptions, type WriteData } from "./files.js";
import {
  Execution, ExecResult, parseContext, parseLogs, parseMetrics, parsePreview, parseSandbox, parseTemplate,
  type CodeContext, type ExecutionError, type FileInfo, type PreviewAccess, type Result,
  type SandboxInfo, type SandboxLogs, type SandboxMetrics, type Template,
} from "./models.js";
import { ExecutionBuilder, type RunNotice } from "./streams.js";
import type { Call, ClientOptions, Event, Transport } from "./transport.js";
import { openTerminal, type Terminal, type TerminalOptions } from "./terminal.js";
import { previewUrl, withToken, wsUrl } from "./urls.js";

export interface ExecOptions {
  /** "python" (default for code), "bash" or "sh". */
  language?: string | undefined;
  /** Seconds (default 60); the run is killed after this long. */
  timeout?: number | undefined;
  env?: Record<string, string> | undefined;
  /** Working directory (relative paths are under /root). */
  cwd?: string | undefined;
}

export interface RunCodeOptions {
  /** Default "python". */
  language?: string | undefined;
  /** A context (or its name); default: the sandbox's default context. */
  context?: string | CodeContext | undefined;
  /** Seconds (default 300). */
  timeout?: number | undefined;
  env?: Record<string, string> | undefined;
  /** Callbacks may be async (they are awaited). Any callback streams the run. */
  onStdout?: ((data: string) => unknown) | undefined;
  onStderr?: ((data: string) => unknown) | undefined;
  onResult?: ((result: Result) => unknown) | undefined;
  onError?: ((error: ExecutionError) => unknown) | undefined;
  /** Stream even without callbacks (the same Execution comes back). */
  stream?: boolean | undefined;
  /** Abort the run's request (the server stops waiting for the client). */
  signal?: AbortSignal | undefined;
}

const contextName = (c: string | CodeContext | undefined): string | undefined =>
  typeof c === "string" || c === undefined ? c : c.name;

async function notify(options: RunCodeOptions, notice: RunNotice | undefined): Promise<void> {
  if (!notice) return;
  switch (notice.type) {
    case "stdout": await options.onStdout?.(notice.data); break;
    case "stderr": await options.onStderr?.(notice.data); break;
    case "result": await options.onResult?.(notice.result); break;
    case "error": await options.onError?.(notice.error); break;
  }
}

export class Sandbox {
  info: SandboxInfo;
  readonly files: Files;
  readonly commands: Commands;
  /** @internal */
  readonly _t: Transport;
  private readonly keep: boolean;

  /** @internal Use `Sandbox.create`, `Sandbox.connect` or `box.create`. */
  constructor(readonly client: AgentBox, info: SandboxInfo, options: { keep?: boolean } = {}) {
    this._t = client._transport;
    this.info = info;
    this.keep = Boolean(options.keep);
    this.files = new Files(info.id, this._t);
    this.commands = new Commands(info.id, this._t);
  }

  get id(): string { return this.info.id; }
  get sandboxId(): string { return this.info.id; }
  /** The state when last fetched (`getInfo()` refreshes it). */
  get state(): string { return this.info.state; }

  toString(): string {
    return `Sandbox(${this.id} ${this.info.state} template=${this.info.template})`;
  }

  // -- making one ---------------------------------------------------------------------------

  /** Create a sandbox (E2B style); the client comes from `options` or the environment. */
  static async create(options: CreateOptions & ClientOptions = {}): Promise<Sandbox> {
    return new AgentBox(options).create(options);
  }

  /** Attach to an existing sandbox (never killed by leaving an `await using` block). */
  static async connect(sandboxId: string, options: ClientOptions = {}): Promise<Sandbox> {
    return new AgentBox(options).connect(sandboxId);
  }

  static async list(options: ClientOptions = {}): Promise<SandboxInfo[]> {
    return new AgentBox(options).list();
  }

  // -- running code -------------------------------------------------------------------------

  /**
   * Run `code` (Python unless `language` is "bash"/"sh") in a fresh process, or a shell
   * command with `execute({ command })`, and wait for it.
   */
  execute(code: string, options?: ExecOptions): Promise<ExecResult>;
  execute(options: ExecOptions & { command: string }): Promise<ExecResult>;
  async execute(codeOrOptions: string | (ExecOptions & { command: string }),
                options: ExecOptions = {}): Promise<ExecResult> {
    const isCode = typeof codeOrOptions === "string";
    const opts = isCode ? options : codeOrOptions;
    const language = opts.language ?? (isCode ? "python" : undefined);
    const call = calls.execute(this.id, {
      code: isCode ? codeOrOptions : undefined, command: isCode ? undefined : codeOrOptions.command,
      language, timeout: opts.timeout, env: opts.env, cwd: opts.cwd,
    });
    return ExecResult.parse(await this._t.json(call), language);
  }

  /**
   * Run `code` in a stateful interpreter context (variables and imports persist between runs,
   * as in Jupyter). With callbacks (or `stream: true`) the output is streamed to them as it
   * happens. Returns the {@link Execution}: stdout, stderr, rich `results`, `error`.
   */
  async runCode(code: string, options: RunCodeOptions = {}): Promise<Execution> {
    const stream = Boolean(options.stream || options.onStdout || options.onStderr
      || options.onResult || options.onError);
    const call = this.runCall(code, options, stream);
    if (!stream) return Execution.parse(await this._t.json(call, options.signal));
    const builder = new ExecutionBuilder();
    for await (const event of this._t.events(call, options.signal)) {
      await notify(options, builder.feed(event));
    }
    return builder.finish();
  }

  /**
   * The raw NDJSON events of a streamed run (`stdout`, `stderr`, `result`, `error`, `end`),
   * as they arrive. Breaking out of the loop closes the stream.
   */
  async *runCodeEvents(code: string, options: Omit<RunCodeOptions, "stream"> = {}):
    AsyncGenerator<Event, void, undefined> {
    yield* this._t.events(this.runCall(code, options, true), options.signal);
  }

  private runCall(code: string, options: RunCodeOptions, stream: boolean): Call {
    return calls.runCode(this.id, {
      code, language: options.language ?? "python", context: contextName(options.context),
      timeout: options.timeout, env: options.env, stream,
    });
  }

  async createCodeContext(options: { name?: string; cwd?: string; env?: Record<string, string> } = {}):
    Promise<CodeContext> {
    return parseContext(await this._t.json(calls.createContext(this.id, options.name, options.cwd, options.env)));
  }

  async listCodeContexts(): Promise<CodeContext[]> {
    const data = await this._t.json<{ contexts?: unknown[] }>(calls.listContexts(this.id));
    return (data?.contexts ?? []).map(parseContext);
  }

  async removeCodeContext(context: string | CodeContext): Promise<void> {
    await this._t.discard(calls.deleteContext(this.id, contextName(context) ?? ""));
  }

  // -- files --------------------------------------------------------------------------------

  /**
   * Write `data` to `path` in the sandbox (as `files.write`). A relative `path` lands under
   * `/input/`: `upload("data.csv", b)` is read as `/input/data.csv`.
   */
  upload(path: string, data: WriteData, options: TransferOptions = {}): Promise<FileInfo> {
    return this.files.write(calls.under(calls.INPUT_DIR, path), data, options);
  }

  /**
   * The file's bytes; or, with `dest`, stream it into that local file and return its path. A
   * relative `path` is read from `/output/` (as `result.files` name them, absolute, either works).
   */
  download(path: string): Promise<Uint8Array>;
  download(path: string, dest: string, options?: TransferOptions): Promise<string>;
  download(path: string, dest?: string, options: TransferOptions = {}): Promise<Uint8Array | string> {
    const from = calls.under(calls.OUTPUT_DIR, path);
    return dest === undefined ? this.files.read(from, { format: "bytes" }) : this.files.download(from, dest, options);
  }

  // -- preview access -----------------------------------------------------------------------

  /**
   * The URL where the gateway serves `port` of this sandbox. Ports are private unless made
   * public: `withToken: true` appends `?token=`, which a browser trades for a cookie on its
   * first visit (programs can send the header `X-AgentBox-Token: <previewToken>` instead).
   */
  async getUrl(port: number, options: { withToken?: boolean } = {}): Promise<string> {
    const url = previewUrl(await this.client.serverInfo(), this._t.config.baseUrl, this.id, port);
    return options.withToken ? withToken(url, await this.previewToken()) : url;
  }

  /** `{port}-{id}.{domain}[:port]`: the host of {@link getUrl}. */
  async getHost(port: number): Promise<string> {
    return new URL(await this.getUrl(port)).host;
  }

  /** The preview token and public ports (`GET .../preview`). */
  async getPreview(): Promise<PreviewAccess> {
    return parsePreview(await this._t.json(calls.getPreview(this.id)));
  }

  /** The token that opens this sandbox's private ports. */
  async previewToken(): Promise<string> {
    return (await this.getPreview()).previewToken;
  }

  /** A new preview token; the old one, and links and cookies made with it, stop working. */
  async rotatePreviewToken(): Promise<string> {
    return parsePreview(await this._t.json(calls.rotatePreviewToken(this.id))).previewToken;
  }

  /** Serve these ports without a token (replaces the list; `[]` = all private). */
  async setPublicPorts(ports: number[]): Promise<PreviewAccess> {
    return parsePreview(await this._t.json(calls.setPublicPorts(this.id, ports)));
  }

  /** The WebSocket URL of this sandbox's terminal (send `Authorization: Bearer <key>`). */
  terminalUrl(): string {
    return wsUrl(this._t.config.baseUrl, `/v1/sandboxes/${encodeURIComponent(this.id)}/terminal`);
  }

  /** An interactive terminal (a PTY running the login shell, or `cmd`); needs the `ws` package. */
  terminal(options: TerminalOptions = {}): Promise<Terminal> {
    return openTerminal(this.terminalUrl(), this._t.config.apiKey, options);
  }

  // -- lifecycle ----------------------------------------------------------------------------

  async getInfo(): Promise<SandboxInfo> {
    this.info = parseSandbox(await this._t.json(calls.getSandbox(this.id)));
    return this.info;
  }

  async isRunning(): Promise<boolean> {
    return (await this.getInfo()).state === "running";
  }

  /** Snapshot the sandbox to disk and stop its VM (it costs no RAM until resumed). */
  async suspend(): Promise<SandboxInfo> {
    this.info = parseSandbox(await this._t.json(calls.suspendSandbox(this.id)));
    return this.info;
  }

  /** Same as {@link suspend} (E2B's name). */
  pause(): Promise<SandboxInfo> {
    return this.suspend();
  }

  async resume(): Promise<SandboxInfo> {
    this.info = parseSandbox(await this._t.json(calls.resumeSandbox(this.id)));
    return this.info;
  }

  /** Suspend after this many idle seconds (0 = never). */
  setIdleTimeout(seconds: number): Promise<SandboxInfo> {
    return this.update({ idleTimeout: seconds });
  }

  /** `ttl` counts from now (extend it; 0 = no deadline); `egress` applies at once, also to a
   * running guest. */
  async update(fields: { idleTimeout?: number; metadata?: Record<string, unknown>; publicPorts?: number[];
                         ttl?: number; autoDeleteAfter?: number; egress?: calls.Egress }): Promise<SandboxInfo> {
    const call = calls.updateSandbox(this.id, fields.idleTimeout, fields.metadata, fields.publicPorts, fields.ttl,
                                     fields.autoDeleteAfter, fields.egress);
    this.info = parseSandbox(await this._t.json(call));
    return this.info;
  }

  /** Replace the egress policy ("deny_all", "allow_all" or `{ default, allow, deny }`); it
   * applies at once, to the running guest too (connections already open stay). */
  setEgress(egress: calls.Egress): Promise<SandboxInfo> {
    return this.update({ egress });
  }

  /** Destroy it `seconds` from now (0 = never). */
  setTtl(seconds: number): Promise<SandboxInfo> {
    return this.update({ ttl: seconds });
  }

  // -- snapshots and forks ------------------------------------------------------------------

  /**
   * Save this sandbox (memory, running processes, files) as the key's template `template`;
   * `box.create({ template })` then starts sandboxes in that state. It keeps running (paused
   * only while it is copied: the Template's `pausedMs`).
   */
  async snapshot(template: string): Promise<Template> {
    return parseTemplate(await this._t.json(calls.snapshotSandbox(this.id, template)));
  }

  /**
   * `n` (1-8) new sandboxes in this one's current state (files, processes, interpreter
   * variables); each then goes its own way. `keep`: as for `create` (`await using`).
   */
  async fork(n = 1, options: { keep?: boolean } = {}): Promise<Sandbox[]> {
    const data = await this._t.json<{ sandboxes?: unknown[] }>(calls.forkSandbox(this.id, n));
    return (data?.sandboxes ?? []).map((s) => new Sandbox(this.client, parseSandbox(s), { keep: options.keep }));
  }

  /** CPU seconds and memory of its VM and its disk use, read on the host (never wakes it). */
  async metrics(): Promise<SandboxMetrics> {
    return parseMetrics(await this._t.json(calls.sandboxMetrics(this.id)));
  }

  /** The last `tail` lines of its console (default 200) and its state changes. */
  async logs(tail?: number): Promise<SandboxLogs> {
    return parseLogs(await this._t.json(calls.sandboxLogs(this.id, tail)));
  }

  /** Destroy the sandbox; false if it was already gone. */
  async kill(): Promise<boolean> {
    try {
      await this._t.discard(calls.deleteSandbox(this.id));
      return true;
    } catch (exc) {
      if (exc instanceof SandboxNotFoundError) return false;
      throw exc;
    }
  }

  /** `await using` (Node 20+): kills the sandbox unless it was made with `keep` or connected to. */
  async [Symbol.asyncDispose](): Promise<void> {
    if (!this.keep) await this.kill();
  }
}
