/**
 * Consumers of the server's NDJSON streams, with no I/O: events in, state and notices out.
 * {@link ExecutionBuilder} folds a streamed `run_code` into an {@link Execution};
 * {@link CommandOutput} folds a command's output into a {@link CommandResult} and remembers the
 * offset to reattach from if the stream breaks. Unknown event types are ignored (a newer server
 * may add some).
 */

import { ProtocolError, StreamInterruptedError } from "./errors.js";
import {
  CommandResult, Execution, ExecutionError, Result, parseOutputFiles, type OutputChunk,
} from "./models.js";
import type { Event } from "./transport.js";

export type RunNotice =
  | { type: "stdout"; data: string }
  | { type: "stderr"; data: string }
  | { type: "result"; result: Result }
  | { type: "error"; error: ExecutionError };

export class ExecutionBuilder {
  private readonly out: string[] = [];
  private readonly err: string[] = [];
  readonly results: Result[] = [];
  error: ExecutionError | null = null;
  ended = false;
  private end: Event = {};

  feed(event: Event): RunNotice | undefined {
    switch (event.type) {
      case "stdout":
      case "stderr": {
        const data = String(event.data ?? "");
        (event.type === "stdout" ? this.out : this.err).push(data);
        return event.type === "stdout" ? { type: "stdout", data } : { type: "stderr", data };
      }
      case "result": {
        const result = Result.parse(event.result);
        this.results.push(result);
        return { type: "result", result };
      }
      case "error":
        this.error = ExecutionError.parse(event.error);
        return { type: "error", error: this.error };
      case "end":
        this.ended = true;
        this.end = event;
        return undefined;
      default:
        return undefined;
    }
  }

  finish(): Execution {
    if (!this.ended) throw new StreamInterruptedError("the run's output stream ended before its 'end' line");
    const count = typeof this.end.execution_count === "number" ? this.end.execution_count : undefined;
    const ms = typeof this.end.duration_ms === "number" ? this.end.duration_ms : undefined;
    return new Execution(this.out.join(""), this.err.join(""), this.results, this.error, count, ms,
      Boolean(this.end.truncated), parseOutputFiles(this.end.files));
  }
}

const byteLength = (s: string): number => new TextEncoder().encode(s).length;

/** State of one command's output stream; `offset` is where to resume reading. */
export class CommandOutput {
  private readonly out: string[] = [];
  private readonly err: string[] = [];
  droppedBytes = 0;
  exitCode: number | undefined;
  timedOut = false;
  done = false;

  constructor(public pid: number | undefined = undefined, public offset = 0) {}

  feed(event: Event): OutputChunk | undefined {
    switch (event.type) {
      case "start":
        this.pid = Number(event.pid);
        return undefined;
      case "stdout":
      case "stderr": {
        const data = String(event.data ?? "");
        const start = typeof event.offset === "number" ? event.offset : this.offset;
        const next = typeof event.next_offset === "number" ? event.next_offset : start + byteLength(data);
        (event.type === "stdout" ? this.out : this.err).push(data);
        this.offset = next;
        return { stream: event.type, data, offset: start, nextOffset: next };
      }
      case "dropped": {
        const next = typeof event.next_offset === "number" ? event.next_offset : this.offset;
        const from = typeof event.offset === "number" ? event.offset : this.offset;
        this.droppedBytes += Math.max(0, next - from);
        this.offset = next;
        return undefined;
      }
      case "exit":
        if (event.exit_code === undefined || event.exit_code === null) {
          throw new ProtocolError("an 'exit' event without an exit_code");
        }
        this.exitCode = Number(event.exit_code);
        this.timedOut = Boolean(event.timed_out);
        this.done = true;
        return undefined;
      default:
        return undefined;
    }
  }

  get stdout(): string {
    return this.out.join("");
  }

  get stderr(): string {
    return this.err.join("");
  }

  result(): CommandResult {
    if (this.exitCode === undefined) {
      throw new StreamInterruptedError("the command's output stream ended before it exited");
    }
    return new CommandResult(this.pid, this.stdout, this.stderr, this.exitCode, this.timedOut);
  }
}
