/** A scripted HTTP server on 127.0.0.1 for the unit tests: each test says what each request gets. */

import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export interface Seen {
  method: string;
  path: string;
  query: URLSearchParams;
  headers: IncomingMessage["headers"];
  body: Buffer;
}

export type Handler = (req: Seen, res: ServerResponse) => void | Promise<void>;

export interface Fake {
  url: string;
  seen: Seen[];
  /** Routes are matched as "METHOD /path" (no query); the first match wins. */
  route(key: string, handler: Handler): void;
  close(): Promise<void>;
}

export function json(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  res.writeHead(status, { "Content-Type": "application/json", ...headers });
  res.end(JSON.stringify(body));
}

export function ndjson(res: ServerResponse, events: unknown[], end = true): void {
  res.writeHead(200, { "Content-Type": "application/x-ndjson" });
  for (const e of events) res.write(`${JSON.stringify(e)}\n`);
  if (end) res.end();
}

export async function startFake(): Promise<Fake> {
  const routes: Array<[string, Handler]> = [];
  const seen: Seen[] = [];
  const server = createServer(async (req, res) => {
    const chunks: Buffer[] = [];
    for await (const chunk of req) chunks.push(chunk as Buffer);
    const url = new URL(req.url ?? "/", "http://x");
    const entry: Seen = { method: req.method ?? "", path: url.pathname, query: url.searchParams,
                          headers: req.headers, body: Buffer.concat(chunks) };
    seen.push(entry);
    const key = `${entry.method} ${entry.path}`;
    const handler = routes.find(([k]) => k === key)?.[1];
    if (!handler) return json(res, 404, { error: { code: "no_route", message: `no route ${key}` } });
    await handler(entry, res);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`, seen,
    route: (key, handler) => { routes.unshift([key, handler]); },
    close: () => new Promise<void>((resolve) => {
      server.closeAllConnections();
      server.close(() => resolve());
    }),
  };
}

export const SANDBOX = {
  id: "sb1", state: "running", template: "python", metadata: {}, created_at: 1, idle_timeout: 300,
  suspend_count: 0, restore_count: 0, some_future_field: true,
};
