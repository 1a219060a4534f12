/**
 * An interactive terminal in a sandbox: `GET /v1/sandboxes/{id}/terminal` as a WebSocket.
 * Binary frames carry raw terminal bytes both ways; text frames are JSON control messages
 * (`{"type":"resize","cols","rows"}` from us, `{"type":"exit","exit_code"}` from the server
 * before it closes).
 *
 * Node's own WebSocket cannot send an `Authorization` header, so this uses the `ws` package,
 * an optional peer dependency loaded only when a terminal is opened (`npm install ws`).
 */

import { ConfigurationError, errorFromResponse } from "./errors.js";
import { mapFetchError, USER_AGENT } from "./transport.js";

export interface TerminalOptions {
  cols?: number | undefined;
  rows?: number | undefined;
  /** A program to run instead of the login shell. */
  cmd?: string | undefined;
  /** Gets the terminal's output as it arrives (may be async; not awaited). */
  onData?: ((data: Uint8Array) => unknown) | undefined;
}

/** The parts of a `ws` WebSocket used here. */
interface WsSocket {
  send(data: string | Uint8Array): void;
  close(code?: number): void;
  on(event: string, listener: (...args: any[]) => void): void;
  once(event: string, listener: (...args: any[]) => void): void;
}
type WsClass = new (url: string, options: { headers: Record<string, string> }) => WsSocket;

async function loadWs(): Promise<WsClass> {
  const name = "ws"; // not a static import: the package is optional
  try {
    const mod = (await import(name)) as { default?: WsClass; WebSocket?: WsClass };
    const cls = mod.WebSocket ?? mod.default;
    if (cls) return cls;
  } catch (exc) {
    throw new ConfigurationError("the terminal needs the ws package: npm install ws", { cause: exc });
  }
  throw new ConfigurationError("the ws package has no WebSocket export");
}

/** An open terminal: `write` keys, `resize`, `close`; `exited` gives the exit code. */
export class Terminal {
  /** The shell's exit code (null if the socket closed without one). */
  readonly exited: Promise<number | null>;
  private exitCode: number | null = null;

  constructor(private readonly socket: WsSocket, onData?: (data: Uint8Array) => unknown) {
    socket.on("message", (data: Buffer | ArrayBuffer | Buffer[], isBinary: boolean) => {
      const bytes = Buffer.isBuffer(data) ? data : Array.isArray(data) ? Buffer.concat(data) : Buffer.from(data);
      if (isBinary) {
        onData?.(new Uint8Array(bytes));
        return;
      }
      try {
        const msg = JSON.parse(bytes.toString("utf8")) as { type?: string; exit_code?: number };
        if (msg.type === "exit" && typeof msg.exit_code === "number") this.exitCode = msg.exit_code;
      } catch {
        // not ours: ignore (a newer server may add control messages)
      }
    });
    this.exited = new Promise((resolve) => socket.once("close", () => resolve(this.exitCode)));
  }

  /** Send keys (text is UTF-8). */
  write(data: string | Uint8Array): void {
    this.socket.send(typeof data === "string" ? new TextEncoder().encode(data) : data);
  }

  resize(cols: number, rows: number): void {
    this.socket.send(JSON.stringify({ type: "resize", cols, rows }));
  }

  /** Hang up (the shell gets SIGHUP). */
  close(): void {
    this.socket.close(1000);
  }
}

/** Open the terminal at `url` (ws://.../terminal) with the API key. */
export async function openTerminal(url: string, apiKey: string, options: TerminalOptions = {}): Promise<Terminal> {
  const WebSocket = await loadWs();
  const params = new URLSearchParams();
  if (options.cols !== undefined) params.set("cols", String(options.cols));
  if (options.rows !== undefined) params.set("rows", String(options.rows));
  if (options.cmd !== undefined) params.set("cmd", options.cmd);
  const query = params.toString() ? `?${params.toString()}` : "";
  const socket = new WebSocket(`${url}${query}`, {
    headers: { Authorization: `Bearer ${apiKey}`, "User-Agent": USER_AGENT },
  });
  const terminal = new Terminal(socket, options.onData);
  await new Promise<void>((resolve, reject) => {
    socket.once("open", () => resolve());
    socket.once("unexpected-response", (_req: unknown, res: NodeJS.ReadableStream & {
      statusCode?: number; headers: Record<string, string | undefined>;
    }) => {
      let body = "";
      res.on("data", (d: Buffer) => { body += d.toString("utf8"); });
      res.on("end", () => reject(errorFromResponse(res.statusCode ?? 0, body, res.headers["retry-after"])));
    });
    socket.once("error", (exc: unknown) => reject(mapFetchError("terminal", exc)));
  });
  return terminal;
}
