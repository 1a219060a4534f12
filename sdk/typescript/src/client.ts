/**
 * `AgentBox`: a connection to one AgentBox server.
 *
 * The key and URL come from the options, else `AGENTBOX_API_KEY` and `AGENTBOX_URL` (default
 * http://127.0.0.1:8080). Every sandbox a client makes shares its connection pool (fetch's).
 */

import * as calls from "./calls.js";
import { InvalidArgumentError, NotFoundError, SandboxNotFoundError } from "./errors.js";
import { parseSandbox, parseServerInfo, parseTemplate, type SandboxInfo, type ServerInfo, type Template } from "./models.js";
import { Sandbox } from "./sandbox.js";
import { Sessions } from "./sessions.js";
import { Transport, resolveConfig, type ClientConfig, type ClientOptions } from "./transport.js";

export const DEFAULT_TEMPLATE = "python";

export interface CreateOptions {
  /** Default "python". */
  template?: string | undefined;
  /** Alias of `template` (the seed examples use it). */
  environment?: string | undefined;
  /** Seconds without activity before it is suspended (0 = never; default: the server's). */
  idleTimeout?: number | undefined;
  metadata?: Record<string, unknown> | undefined;
  /** `await using` does not kill it at the end of the block. */
  keep?: boolean | undefined;
  /** Its shape (default: the template's; the server's limits apply). */
  vcpus?: number | undefined;
  memoryMib?: number | undefined;
  diskMib?: number | undefined;
}

function pickTemplate(options: CreateOptions): string {
  const { template, environment } = options;
  if (environment !== undefined && template !== undefined && template !== environment) {
    throw new InvalidArgumentError(`template=${template} and environment=${environment} disagree; give one of them`);
  }
  return environment ?? template ?? DEFAULT_TEMPLATE;
}

export class AgentBox {
  readonly config: ClientConfig;
  /** Named long-lived sandboxes. */
  readonly sessions: Sessions;
  /** @internal */
  readonly _transport: Transport;
  private info: Promise<ServerInfo> | undefined;

  constructor(options: ClientOptions = {}) {
    this.config = resolveConfig(options);
    this._transport = new Transport(this.config, options.fetch);
    this.sessions = new Sessions(this);
  }

  toString(): string {
    return `AgentBox(${this.config.baseUrl})`;
  }

  /** A new sandbox from `template` (alias `environment`; default "python"). */
  async create(options: CreateOptions = {}): Promise<Sandbox> {
    const call = calls.createSandbox(pickTemplate(options), options.idleTimeout, options.metadata,
      { vcpus: options.vcpus, memory_mib: options.memoryMib, disk_mib: options.diskMib });
    return new Sandbox(this, parseSandbox(await this._transport.json(call)), { keep: options.keep });
  }

  /** An existing sandbox (`await using` does not kill it). */
  async connect(sandboxId: string): Promise<Sandbox> {
    return new Sandbox(this, await this.get(sandboxId), { keep: true });
  }

  async get(sandboxId: string): Promise<SandboxInfo> {
    return parseSandbox(await this._transport.json(calls.getSandbox(sandboxId)));
  }

  /** This key's sandboxes. */
  async list(): Promise<SandboxInfo[]> {
    const data = await this._transport.json<{ sandboxes?: unknown[] }>(calls.listSandboxes());
    return (data?.sandboxes ?? []).map(parseSandbox);
  }

  /** Destroy a sandbox; false if it did not exist. */
  async kill(sandboxId: string): Promise<boolean> {
    try {
      await this._transport.discard(calls.deleteSandbox(sandboxId));
      return true;
    } catch (exc) {
      if (exc instanceof SandboxNotFoundError) return false;
      throw exc;
    }
  }

  async templates(): Promise<Template[]> {
    const data = await this._transport.json<{ templates?: unknown[] }>(calls.templates());
    return (data?.templates ?? []).map(parseTemplate);
  }

  /** `GET /v1/info` (fetched once; empty if the server does not have it). */
  serverInfo(): Promise<ServerInfo> {
    this.info ??= this._transport.json(calls.serverInfo()).then(parseServerInfo, (exc: unknown) => {
      if (exc instanceof NotFoundError) return parseServerInfo({});
      this.info = undefined; // not cached: try again next time
      throw exc;
    });
    return this.info;
  }
}
