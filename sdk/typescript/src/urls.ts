/** Preview and session URLs (pure): from the server's templates, else the default domains. */

import { InvalidArgumentError } from "./errors.js";
import type { ServerInfo } from "./models.js";

function origin(baseUrl: string): { scheme: string; port: string } {
  const url = new URL(baseUrl);
  return { scheme: url.protocol.replace(/:$/, "") || "http", port: url.port ? `:${url.port}` : "" };
}

/**
 * The URL under which the gateway serves `port` of a sandbox: from `preview_url_template`
 * (`GET /v1/info`), else `{scheme}://{port}-{id}.localhost[:{gateway port}]`.
 */
export function previewUrl(info: ServerInfo | undefined, baseUrl: string, sandboxId: string,
                           port: number): string {
  if (!Number.isInteger(port) || port <= 0 || port >= 65536) {
    throw new InvalidArgumentError(`port must be 1-65535, not ${String(port)}`);
  }
  let template = info?.previewUrlTemplate;
  if (!template) {
    const { scheme, port: suffix } = origin(baseUrl);
    template = `${scheme}://{port}-{id}.localhost${suffix}`;
  }
  return template.replaceAll("{port}", String(port)).replaceAll("{id}", sandboxId);
}

/** `url` carrying the preview token once (the gateway answers with a cookie). */
export function withToken(url: string, token: string): string {
  const parsed = new URL(url);
  parsed.searchParams.set("token", token);
  return parsed.toString();
}

/**
 * A session's URL: from `session_url_template`, else the one the server gave, else
 * `{scheme}://{name}.sessions.localhost[:{gateway port}]`.
 */
export function sessionUrl(info: ServerInfo | undefined, baseUrl: string, name: string,
                           given?: string | null): string {
  if (info?.sessionUrlTemplate) return info.sessionUrlTemplate.replaceAll("{name}", name);
  if (given) return given;
  const { scheme, port } = origin(baseUrl);
  return `${scheme}://${name}.sessions.localhost${port}`;
}

/** The WebSocket URL of `path` on the API server. */
export function wsUrl(baseUrl: string, path: string): string {
  return baseUrl.replace(/^http/, "ws") + path;
}
