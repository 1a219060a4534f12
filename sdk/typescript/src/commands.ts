/**
 * `sandbox.commands`: shell commands, in the foreground or in the background.
 *
 * A foreground run streams its output to the caller and is killed by the sandbox if the caller
 * goes away. A background run answers at once with a {@link CommandHandle}; its output is kept
 * in the sandbox (the last 4 MiB, with absolute byte offsets), so a handle can follow it, lose
 * the connection, and reattach from the last offset it saw: by itself, or from another process
 * with `commands.connect(pid, { offset })`, also across a suspend and resume.
 */

import * as calls from "./calls.js";
import {
  APIConnectionError, ConflictError, StreamInterruptedError, TimeoutError,
} from "./errors.js";
import { parseProcess, type CommandResult, type OutputChunk, type ProcessInfo } from "./models.js";
import { CommandOutput } from "./streams.js";
import type { Transport } from "./transport.js";

/** Gets each chunk of output as a string; may be async (it is awaited). */
export type OutputCallback = (data: string) => unknown;

export interface OutputCallbacks {
  onStdout?: OutputCallback | undefined;
  onStderr?: OutputCallback | undefined;
}

export interface CommandOptions extends OutputCallbacks {
  env?: Record<string, string> | undefined;
  /** Working directory (relative paths are under /root). */
  cwd?: string | undefined;
  /** Seconds; the sandbox kills the command after this long. */
  timeout?: number | undefined;
  /** Keep a stdin pipe open for `sendStdin`. */
  stdin?: boolean | undefined;
}

export const MAX_REATTACH = 5;

/** Milliseconds to wait before reattach attempt `attempt` (1-based), or undefined: give up. */
export function reattachDelay(attempt: number): number | undefined {
  return attempt > MAX_REATTACH ? undefined : Math.min(100 * 2 ** (attempt - 1), 2000);
}

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));

async function notify(callbacks: OutputCallbacks, chunk: OutputChunk | undefined): Promise<void> {
  if (!chunk) return;
  const callback = chunk.stream === "stdout" ? callbacks.onStdout : callbacks.onStderr;
  if (callback) await callback(chunk.data);
}

/**
 * A background command. `for await (const chunk of handle)` follows its output until it exits;
 * `wait()` gives its {@link CommandResult}. `offset` is where the next read starts: keep it to
 * reattach later with `sandbox.commands.connect(pid, { offset })`.
 */
export class CommandHandle implements AsyncIterable<OutputChunk> {
  private readonly out: CommandOutput;
  private callbacks: OutputCallbacks;

  constructor(private readonly sandboxId: string, private readonly t: Transport,
              readonly pid: number, offset = 0, callbacks: OutputCallbacks = {}) {
    this.out = new CommandOutput(pid, offset);
    this.callbacks = callbacks;
  }

  get offset(): number { return this.out.offset; }
  /** The exit code, once the output has been followed to the end. */
  get exitCode(): number | undefined { return this.out.exitCode; }
  /** Everything read from stdout so far (by iterating or waiting). */
  get stdout(): string { return this.out.stdout; }
  get stderr(): string { return this.out.stderr; }
  /** Bytes the sandbox no longer had when we asked for them (over its 4 MiB buffer). */
  get droppedBytes(): number { return this.out.droppedBytes; }

  [Symbol.asyncIterator](): AsyncIterator<OutputChunk> {
    return this.follow(undefined);
  }

  private async *follow(timeout: number | undefined): AsyncGenerator<OutputChunk, void, undefined> {
    const end = timeout === undefined ? undefined : Date.now() + timeout * 1000;
    const remaining = (): number | undefined => {
      if (end === undefined) return undefined;
      const left = (end - Date.now()) / 1000;
      if (left <= 0) throw new TimeoutError(`command ${this.pid} is still running (wait timed out)`);
      return left;
    };
    let attempt = 0;
    while (!this.out.done) {
      const call = calls.commandOutput(this.sandboxId, this.pid, this.out.offset, true);
      if (end !== undefined) call.timeout = remaining() ?? null;
      try {
        for await (const event of this.t.events(call)) {
          const chunk = this.out.feed(event);
          if (chunk) {
            attempt = 0;
            await notify(this.callbacks, chunk);
            yield chunk;
          }
        }
      } catch (exc) {
        if (exc instanceof TimeoutError) {
          remaining(); // our own deadline: the message says so
          throw exc;
        }
        if (!(exc instanceof APIConnectionError)) throw exc;
        // else: reattach below from the last offset we saw
      }
      if (!this.out.done) {
        const delay = reattachDelay(++attempt);
        if (delay === undefined) {
          throw new StreamInterruptedError(`lost command ${this.pid}'s output ${MAX_REATTACH} times; `
            + `reattach with commands.connect(${this.pid}, { offset: ${this.out.offset} })`);
        }
        await sleep(delay);
      }
    }
  }

  /**
   * Follow the output until the command exits. `timeout` (seconds): throw
   * {@link TimeoutError} after this long (the command keeps running; wait again or kill it).
   */
  async wait(options: { timeout?: number | undefined } & OutputCallbacks = {}): Promise<CommandResult> {
    if (options.onStdout || options.onStderr) {
      this.callbacks = { onStdout: options.onStdout, onStderr: options.onStderr };
    }
    for await (const _chunk of this.follow(options.timeout)) {
      // callbacks ran in follow()
    }
    return this.out.result();
  }

  /** Signal the command's process group; false if it was no longer running. */
  async kill(signal: string | number = "SIGKILL"): Promise<boolean> {
    try {
      await this.t.discard(calls.signalCommand(this.sandboxId, this.pid, signal));
      return true;
    } catch (exc) {
      if (exc instanceof ConflictError) return false;
      throw exc;
    }
  }

  /** Write to the command's stdin (it must have been started with `stdin: true`). */
  async sendStdin(data: string | Uint8Array, options: { eof?: boolean } = {}): Promise<void> {
    await this.t.discard(calls.commandStdin(this.sandboxId, this.pid, calls.toBytes(data),
      Boolean(options.eof)));
  }

  async closeStdin(): Promise<void> {
    await this.sendStdin(new Uint8Array(), { eof: true });
  }

  async info(): Promise<ProcessInfo> {
    return parseProcess(await this.t.json(calls.getCommand(this.sandboxId, this.pid)));
  }
}

export class Commands {
  constructor(private readonly sandboxId: string, private readonly t: Transport) {}

  /**
   * Run `cmd` under bash. Foreground: wait and return its {@link CommandResult} (a non-zero
   * exit is not an exception: check `exitCode`). `background: true`: return a
   * {@link CommandHandle} at once.
   */
  run(cmd: string, options: CommandOptions & { background: true }): Promise<CommandHandle>;
  run(cmd: string, options?: CommandOptions & { background?: false | undefined }): Promise<CommandResult>;
  run(cmd: string, options?: CommandOptions & { background?: boolean | undefined }):
    Promise<CommandResult | CommandHandle>;
  async run(cmd: string, options: CommandOptions & { background?: boolean | undefined } = {}):
    Promise<CommandResult | CommandHandle> {
    const background = Boolean(options.background);
    const call = calls.startCommand(this.sandboxId, {
      command: cmd, background, env: options.env, cwd: options.cwd,
      stdin: Boolean(options.stdin), timeout: options.timeout,
    });
    const callbacks = { onStdout: options.onStdout, onStderr: options.onStderr };
    if (background) {
      const info = parseProcess(await this.t.json(call));
      return new CommandHandle(this.sandboxId, this.t, info.pid, 0, callbacks);
    }
    const out = new CommandOutput();
    for await (const event of this.t.events(call)) {
      await notify(callbacks, out.feed(event));
    }
    return out.result();
  }

  /** Running commands and recently finished ones (oldest first). */
  async list(): Promise<ProcessInfo[]> {
    const data = await this.t.json<{ commands?: unknown[] }>(calls.listCommands(this.sandboxId));
    return (data?.commands ?? []).map(parseProcess);
  }

  async get(pid: number): Promise<ProcessInfo> {
    return parseProcess(await this.t.json(calls.getCommand(this.sandboxId, pid)));
  }

  kill(pid: number, signal: string | number = "SIGKILL"): Promise<boolean> {
    return new CommandHandle(this.sandboxId, this.t, pid).kill(signal);
  }

  sendStdin(pid: number, data: string | Uint8Array, options: { eof?: boolean } = {}): Promise<void> {
    return new CommandHandle(this.sandboxId, this.t, pid).sendStdin(data, options);
  }

  /**
   * A handle on a command started earlier (checks that it exists); its output is read from
   * `offset` (0: the oldest output still kept).
   */
  async connect(pid: number, options: { offset?: number } & OutputCallbacks = {}): Promise<CommandHandle> {
    await this.get(pid);
    return new CommandHandle(this.sandboxId, this.t, pid, options.offset ?? 0,
      { onStdout: options.onStdout, onStderr: options.onStderr });
  }
}
