/**
 * `AgentBox`: a connection to one AgentBox server.
 *
 * The key and URL come from the options, else `AGENTBOX_API_KEY` and `AGENTBOX_URL` (default
 * http://127.0.0.1:8080). Every sandbox a client makes shares its connection pool (fetch's).
 */

import * as calls from "./calls.js";
import { InvalidArgumentError, NotFoundError, SandboxNotFoundError } from "./errors.js";
import {
  parseSandbox, parseSandboxPage, parseServerInfo, parseUsage, type SandboxInfo, type SandboxPage,
  type ServerInfo, type Usage,
} from "./models.js";
import { Sandbox } from "./sandbox.js";
import { Sessions } from "./sessions.js";
import { Builds, templatesOf, type Templates } from "./templates.js";
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
  /** Seconds after create before it is destroyed (0 = never; default: the server's). */
  ttl?: number | undefined;
  /** Seconds suspended before it is destroyed (0 = never; default: the server's). */
  autoDeleteAfter?: number | undefined;
  /** Its shape (default: the template's; the server's limits apply). */
  vcpus?: number | undefined;
  memoryMib?: number | undefined;
  diskMib?: number | undefined;
  /** Its egress policy: "deny_all", "allow_all" or `{ default, allow, deny }` (default: the host's). */
  egress?: calls.Egress | undefined;
}

export interface ListOptions extends calls.ListFilters {
  /** At most this many (default: every page). */
  limit?: number | undefined;
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
  /** Templates: `await box.templates()` lists them; `.get(name)`, `.delete(name)`, `.build(...)`. */
  readonly templates: Templates;
  /** Templates built from a Dockerfile: `build`, `start`, `get`, `logs`, `wait`. */
  readonly builds: Builds;
  /** @internal */
  readonly _transport: Transport;
  private info: Promise<ServerInfo> | undefined;

  constructor(options: ClientOptions = {}) {
    this.config = resolveConfig(options);
    this._transport = new Transport(this.config, options.fetch);
    this.sessions = new Sessions(this);
    this.builds = new Builds(this._transport);
    this.templates = templatesOf(this._transport, this.builds);
  }

  toString(): string {
    return `AgentBox(${this.config.baseUrl})`;
  }

  /** A new sandbox from `template` (alias `environment`; default "python"). */
  async create(options: CreateOptions = {}): Promise<Sandbox> {
    const call = calls.createSandbox(pickTemplate(options), options.idleTimeout, options.metadata, options.ttl,
                                     options.autoDeleteAfter,
                                     { vcpus: options.vcpus, memory_mib: options.memoryMib, disk_mib: options.diskMib },
                                     options.egress);
    return new Sandbox(this, parseSandbox(await this._transport.json(call)), { keep: options.keep });
  }

  /** An existing sandbox (`await using` does not kill it). */
  async connect(sandboxId: string): Promise<Sandbox> {
    return new Sandbox(this, await this.get(sandboxId), { keep: true });
  }

  async get(sandboxId: string): Promise<SandboxInfo> {
    return parseSandbox(await this._transport.json(calls.getSandbox(sandboxId)));
  }

  /** This key's sandboxes that match every filter, oldest first: every page, or at most `limit`. */
  async list(options: ListOptions = {}): Promise<SandboxInfo[]> {
    const out: SandboxInfo[] = [];
    const pageSize = Math.min(options.limit ?? 100, 1000);
    for await (const info of this.iterSandboxes(options, pageSize)) {
      if (options.limit !== undefined && out.length >= options.limit) break;
      out.push(info);
    }
    return out;
  }

  /** One page of {@link list} (pass its `nextCursor` back for the next one). */
  async listPage(filters: calls.ListFilters = {}, limit?: number, cursor?: string): Promise<SandboxPage> {
    return parseSandboxPage(await this._transport.json(calls.listSandboxes(filters, limit, cursor)));
  }

  /** Every matching sandbox, fetched a page at a time. */
  async *iterSandboxes(filters: calls.ListFilters = {}, pageSize = 100): AsyncGenerator<SandboxInfo, void, undefined> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.listPage(filters, pageSize, cursor);
      yield* page.sandboxes;
      if (page.nextCursor === null) return;
      cursor = page.nextCursor;
    }
  }

  /** Metered use in [from, to) (Unix seconds) of this key; an admin key may ask for `key` (or "*"). */
  async usage(options: { from?: number; to?: number; key?: string } = {}): Promise<Usage> {
    return parseUsage(await this._transport.json(calls.usage(options.from, options.to, options.key)));
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
