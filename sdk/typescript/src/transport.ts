/**
 * HTTP transport: the one place the SDK touches `fetch`.
 *
 * A {@link Call} (built by `calls.ts`, no I/O) says what to send; {@link Transport} sends it,
 * maps every failure into `errors.ts` (HTTP errors by the server's code, fetch's own errors by
 * kind, the original kept as `cause`), and hands back parsed JSON, bytes, or NDJSON events.
 */

import {
  AgentBoxError, APIConnectionError, ConfigurationError, ProtocolError, TimeoutError,
  errorFromResponse,
} from "./errors.js";

export const DEFAULT_URL = "http://127.0.0.1:8080";
/** Seconds; covers a create that has to wait for a busy host. */
export const DEFAULT_TIMEOUT = 120;
export const USER_AGENT = "agentbox-typescript/0.1";

export type Body = string | Uint8Array | ReadableStream<Uint8Array> | Blob;

/** One HTTP request, as data. `timeout`: seconds for the whole exchange (null = no limit). */
export interface Call {
  method: string;
  path: string;
  params?: Record<string, string> | undefined;
  json?: unknown;
  body?: Body | undefined;
  headers?: Record<string, string> | undefined;
  timeout?: number | null | undefined;
}

export interface ClientOptions {
  /** Default: `AGENTBOX_API_KEY`. */
  apiKey?: string | undefined;
  /** Default: `AGENTBOX_URL`, else http://127.0.0.1:8080. */
  baseUrl?: string | undefined;
  /** Seconds for one request (default 120); long runs get their own limit on top. */
  timeout?: number | undefined;
  /** A `fetch` to use instead of the global one (tests, proxies). */
  fetch?: typeof fetch | undefined;
}

export interface ClientConfig {
  apiKey: string;
  baseUrl: string;
  timeout: number;
}

function env(name: string): string | undefined {
  const value = typeof process !== "undefined" ? process.env[name] : undefined;
  return value ? value : undefined;
}

/** Options first, then `AGENTBOX_API_KEY` / `AGENTBOX_URL`, then the defaults. */
export function resolveConfig(options: ClientOptions = {}): ClientConfig {
  const apiKey = options.apiKey || env("AGENTBOX_API_KEY");
  if (!apiKey) {
    throw new ConfigurationError("no API key: pass apiKey or set AGENTBOX_API_KEY");
  }
  let baseUrl = (options.baseUrl || env("AGENTBOX_URL") || DEFAULT_URL).replace(/\/+$/, "");
  if (!baseUrl.includes("://")) baseUrl = `http://${baseUrl}`;
  return { apiKey, baseUrl, timeout: options.timeout ?? DEFAULT_TIMEOUT };
}

/** An NDJSON event: one line of a streamed answer. */
export type Event = { type?: string } & Record<string, unknown>;

export function parseLine(line: string): Event | undefined {
  if (!line.trim()) return undefined;
  let event: unknown;
  try {
    event = JSON.parse(line);
  } catch (exc) {
    throw new ProtocolError(`bad NDJSON line from the server: ${line.slice(0, 200)}`, { cause: exc });
  }
  if (typeof event !== "object" || event === null || Array.isArray(event)) {
    throw new ProtocolError(`NDJSON line is not an object: ${line.slice(0, 200)}`);
  }
  return event as Event;
}

/** fetch's failures as ours. */
export function mapFetchError(what: string, exc: unknown): AgentBoxError {
  if (exc instanceof AgentBoxError) return exc;
  const name = (exc as { name?: string } | null)?.name;
  if (name === "TimeoutError") return new TimeoutError(`${what}: timed out`, { cause: exc });
  if (name === "AbortError") return new APIConnectionError(`${what}: aborted`, { cause: exc });
  const cause = (exc as { cause?: { code?: string; message?: string } } | null)?.cause;
  const detail = cause?.code ?? cause?.message ?? (exc as Error | null)?.message ?? String(exc);
  return new APIConnectionError(`${what}: ${detail}`, { cause: exc });
}

export class Transport {
  readonly config: ClientConfig;
  private readonly fetchImpl: typeof fetch;

  constructor(config: ClientConfig, fetchImpl?: typeof fetch) {
    this.config = config;
    this.fetchImpl = fetchImpl ?? globalThis.fetch;
    if (typeof this.fetchImpl !== "function") {
      throw new ConfigurationError("no global fetch: use Node 18+ or pass options.fetch");
    }
  }

  url(call: Pick<Call, "path" | "params">): string {
    const query = call.params ? `?${new URLSearchParams(call.params).toString()}` : "";
    return `${this.config.baseUrl}${call.path}${query}`;
  }

  /** Send `call`; an answer >= 400 is thrown as its error, with the body read. */
  async send(call: Call, signal?: AbortSignal): Promise<Response> {
    const what = `${call.method} ${call.path}`;
    const headers: Record<string, string> = {
      Authorization: `Bearer ${this.config.apiKey}`, "User-Agent": USER_AGENT, ...call.headers,
    };
    let body: Body | undefined = call.body;
    if (call.json !== undefined) {
      body = JSON.stringify(call.json);
      headers["Content-Type"] = "application/json";
    }
    const init: RequestInit & { duplex?: "half" } = { method: call.method, headers };
    if (body !== undefined) init.body = body as NonNullable<RequestInit["body"]>;
    if (body instanceof ReadableStream) init.duplex = "half"; // required for streamed uploads
    const timeout = call.timeout === undefined ? this.config.timeout : call.timeout;
    const signals = [signal, timeout === null ? undefined : AbortSignal.timeout(timeout * 1000)]
      .filter((s): s is AbortSignal => s !== undefined);
    if (signals.length) init.signal = anySignal(signals);
    let resp: Response;
    try {
      resp = await this.fetchImpl(this.url(call), init);
    } catch (exc) {
      throw mapFetchError(what, exc);
    }
    if (resp.status >= 400) {
      const text = await readText(resp, what);
      throw errorFromResponse(resp.status, text, resp.headers.get("retry-after"));
    }
    return resp;
  }

  /** The parsed JSON answer (undefined for 204 or an empty body). */
  async json<T = unknown>(call: Call, signal?: AbortSignal): Promise<T> {
    const resp = await this.send(call, signal);
    const what = `${call.method} ${call.path}`;
    const text = await readText(resp, what);
    if (resp.status === 204 || !text) return undefined as T;
    try {
      return JSON.parse(text) as T;
    } catch (exc) {
      throw new ProtocolError(`the server answered non-JSON: ${text.slice(0, 200)}`, { cause: exc });
    }
  }

  /** Send and discard the answer's body. */
  async discard(call: Call): Promise<void> {
    const resp = await this.send(call);
    await readText(resp, `${call.method} ${call.path}`);
  }

  /**
   * The NDJSON events of a streamed answer. Breaking out of the loop (or `signal`) closes
   * the connection; a broken connection is an {@link APIConnectionError}.
   */
  async *events(call: Call, signal?: AbortSignal): AsyncGenerator<Event, void, undefined> {
    const what = `${call.method} ${call.path}`;
    const resp = await this.send(call, signal);
    if (!resp.body) return;
    for await (const line of lines(resp.body, what)) {
      const event = parseLine(line);
      if (event !== undefined) yield event;
    }
  }
}

async function readText(resp: Response, what: string): Promise<string> {
  try {
    return await resp.text();
  } catch (exc) {
    throw mapFetchError(what, exc);
  }
}

/** The lines of a byte stream (UTF-8), read as they arrive; cancels the stream when left early. */
export async function* lines(body: ReadableStream<Uint8Array>,
                             what: string): AsyncGenerator<string, void, undefined> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  let done = false;
  try {
    while (true) {
      let chunk: Awaited<ReturnType<typeof reader.read>>;
      try {
        chunk = await reader.read();
      } catch (exc) {
        throw mapFetchError(what, exc);
      }
      if (chunk.done) break;
      buffered += decoder.decode(chunk.value, { stream: true });
      let newline: number;
      while ((newline = buffered.indexOf("\n")) >= 0) {
        yield buffered.slice(0, newline);
        buffered = buffered.slice(newline + 1);
      }
    }
    buffered += decoder.decode();
    if (buffered) yield buffered;
    done = true;
  } finally {
    if (!done) await reader.cancel().catch(() => undefined);
    reader.releaseLock();
  }
}

/** An AbortSignal that fires when any of `signals` does (AbortSignal.any is Node 20+). */
export function anySignal(signals: AbortSignal[]): AbortSignal {
  if (signals.length === 1) return signals[0]!;
  const any = (AbortSignal as unknown as { any?: (s: AbortSignal[]) => AbortSignal }).any;
  if (any) return any(signals);
  const controller = new AbortController();
  for (const s of signals) {
    if (s.aborted) {
      controller.abort(s.reason);
      break;
    }
    s.addEventListener("abort", () => controller.abort(s.reason), { once: true });
  }
  return controller.signal;
}
