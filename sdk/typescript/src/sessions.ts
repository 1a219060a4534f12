/**
 * `box.sessions`: named, long-lived sandboxes (`/v1/sessions`).
 *
 * A session's sandbox suspends when idle and wakes on the next request to its URL, with its
 * processes' memory intact; it lives until the session is deleted. `put` is idempotent: it
 * creates the session (running `start` once in the new sandbox) or returns the existing one
 * unchanged. The session's `url` is built from the server's `session_url_template`.
 */

import * as calls from "./calls.js";
import type { AgentBox } from "./client.js";
import { NotFoundError, SessionNotFoundError } from "./errors.js";
import { parseSessionView, type SessionView } from "./models.js";
import type { Sandbox } from "./sandbox.js";
import { sessionUrl } from "./urls.js";

/** A session, as the server last described it; `sandbox()` connects to its sandbox. */
export class Session implements SessionView {
  readonly name!: string;
  readonly sandboxId!: string | null;
  /** Its sandbox's state ("creating" before it has one). */
  readonly state!: string;
  readonly port!: number;
  /** The host form, e.g. http://myapp.sessions.localhost:8080 (private: send previewToken). */
  readonly url!: string;
  /** The API-key form: /v1/sessions/{name}/proxy/. */
  readonly proxyPath!: string | null;
  readonly previewToken!: string | null;
  readonly start!: string | null;
  readonly startState!: string;
  readonly startPid!: number | null;
  readonly startError!: string | null;
  readonly metadata!: Record<string, unknown>;
  readonly createdAt!: number | undefined;

  constructor(private readonly client: AgentBox, view: SessionView, url: string) {
    Object.assign(this, view, { url });
  }

  /** The session's sandbox, connected (leaving an `await using` block does not kill it). */
  async sandbox(): Promise<Sandbox> {
    if (!this.sandboxId) {
      throw new NotFoundError(`session '${this.name}' has no sandbox yet`, { status: 404, code: "session_not_ready" });
    }
    return this.client.connect(this.sandboxId);
  }

  toJSON(): SessionView {
    const { client: _client, ...view } = this as unknown as Record<string, unknown>;
    return view as unknown as SessionView;
  }
}

export class Sessions {
  constructor(private readonly client: AgentBox) {}

  private async parse(data: unknown): Promise<Session> {
    const view = parseSessionView(data);
    const info = await this.client.serverInfo();
    return new Session(this.client, view, sessionUrl(info, this.client.config.baseUrl, view.name, view.url));
  }

  /**
   * The session `name`: created if it does not exist (from `template`, serving `port`, default
   * 8000; `start` is a shell command run once, in the background, in its new sandbox), else
   * returned as it is (the options are then ignored).
   */
  async put(name: string, options: calls.SessionSpec = {}): Promise<Session> {
    return this.parse(await this.client._transport.json(calls.putSession(name, options)));
  }

  async get(name: string): Promise<Session> {
    return this.parse(await this.client._transport.json(calls.getSession(name)));
  }

  /** This key's sessions. */
  async list(): Promise<Session[]> {
    const data = await this.client._transport.json<{ sessions?: unknown[] }>(calls.listSessions());
    return Promise.all((data?.sessions ?? []).map((s) => this.parse(s)));
  }

  /** Destroy the session's sandbox and free the name; false if there was none. */
  async delete(name: string): Promise<boolean> {
    try {
      await this.client._transport.discard(calls.deleteSession(name));
      return true;
    } catch (exc) {
      if (exc instanceof SessionNotFoundError) return false;
      throw exc;
    }
  }
}
