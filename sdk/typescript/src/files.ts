/**
 * `sandbox.files`: read, write, list and remove files in a sandbox.
 *
 * Paths are absolute in the sandbox; a relative path is taken from /root. Uploads and
 * downloads stream: neither side holds a large file in memory unless the caller asks for its
 * text or bytes. `GET` on a directory answers its listing as JSON, which is how `list` and the
 * directory checks work.
 */

import { createReadStream, createWriteStream } from "node:fs";
import { stat as localStat } from "node:fs/promises";
import { Writable } from "node:stream";

import * as calls from "./calls.js";
import { InvalidArgumentError, NotFoundError, SandboxNotFoundError } from "./errors.js";
import { mapFetchError } from "./transport.js";
import { parseFileInfo, type FileInfo } from "./models.js";
import type { Body, Transport } from "./transport.js";

/** What `write` accepts: text (UTF-8), bytes, a Blob, or a stream / async iterable of bytes. */
export type WriteData = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>
  | AsyncIterable<Uint8Array>;
/** Called with (bytes sent or received so far, total or undefined when unknown). */
export type Progress = (done: number, total: number | undefined) => void;

export interface TransferOptions {
  onProgress?: Progress | undefined;
}

function isJson(resp: Response): boolean {
  return (resp.headers.get("content-type") ?? "").startsWith("application/json");
}

/** A ReadableStream over an async iterable (ReadableStream.from is Node 20.6+). */
function toStream(source: AsyncIterable<Uint8Array>): ReadableStream<Uint8Array> {
  const it = source[Symbol.asyncIterator]();
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      const next = await it.next();
      if (next.done) controller.close();
      else controller.enqueue(next.value instanceof Uint8Array ? next.value : new Uint8Array(next.value));
    },
    async cancel(reason) {
      await it.return?.(reason);
    },
  });
}

function counted(stream: ReadableStream<Uint8Array>, total: number | undefined,
                 onProgress: Progress): ReadableStream<Uint8Array> {
  let done = 0;
  return stream.pipeThrough(new TransformStream<Uint8Array, Uint8Array>({
    transform(chunk, controller) {
      done += chunk.byteLength;
      controller.enqueue(chunk);
      onProgress(done, total);
    },
  }));
}

/** The request body for `data`, and its size when known. */
function prepare(data: WriteData): [Body, number | undefined] {
  if (typeof data === "string") {
    const bytes = new TextEncoder().encode(data);
    return [bytes, bytes.byteLength];
  }
  if (data instanceof Uint8Array) return [data, data.byteLength];
  if (data instanceof ArrayBuffer) return [new Uint8Array(data), data.byteLength];
  if (typeof Blob !== "undefined" && data instanceof Blob) return [data, data.size];
  if (data instanceof ReadableStream) return [data, undefined];
  if (data && typeof (data as AsyncIterable<Uint8Array>)[Symbol.asyncIterator] === "function") {
    return [toStream(data as AsyncIterable<Uint8Array>), undefined];
  }
  throw new InvalidArgumentError(`cannot upload a ${typeof data}: give a string, bytes, a Blob, `
    + "a ReadableStream or an async iterable of bytes");
}

function withProgress(body: Body, size: number | undefined, onProgress?: Progress): Body {
  if (!onProgress) return body;
  if (body instanceof ReadableStream) return counted(body, size, onProgress);
  const bytes = typeof body === "string" ? new TextEncoder().encode(body) : body;
  if (bytes instanceof Uint8Array) {
    // One report per 256 KiB slice, so a large buffer still shows progress.
    let offset = 0;
    return counted(new ReadableStream<Uint8Array>({
      pull(controller) {
        if (offset >= bytes.byteLength) return controller.close();
        controller.enqueue(bytes.subarray(offset, offset + 256 * 1024));
        offset += 256 * 1024;
      },
    }), size, onProgress);
  }
  return counted((bytes as Blob).stream() as ReadableStream<Uint8Array>, size, onProgress);
}

export class Files {
  constructor(private readonly sandboxId: string, private readonly t: Transport) {}

  /**
   * Write `data` to `path`, creating parent directories; atomic on the sandbox side (readers
   * see the old file or the whole new one).
   */
  async write(path: string, data: WriteData, options: TransferOptions = {}): Promise<FileInfo> {
    const [body, size] = prepare(data);
    const sent = withProgress(body, size, options.onProgress);
    const streamed = sent instanceof ReadableStream;
    return parseFileInfo(await this.t.json(calls.writeFile(this.sandboxId, path, sent,
      streamed ? size : undefined)));
  }

  /** Upload the local file `localPath` to `path` in the sandbox, streamed. */
  async upload(path: string, localPath: string, options: TransferOptions = {}): Promise<FileInfo> {
    let size: number;
    try {
      const st = await localStat(localPath);
      if (!st.isFile()) throw new Error("not a regular file");
      size = st.size;
    } catch (exc) {
      throw new InvalidArgumentError(`not a local file: ${localPath}`, { cause: exc });
    }
    const body = toStream(createReadStream(localPath) as AsyncIterable<Uint8Array>);
    const sent = options.onProgress ? counted(body, size, options.onProgress) : body;
    return parseFileInfo(await this.t.json(calls.writeFile(this.sandboxId, path, sent, size)));
  }

  /** The file's content: text (UTF-8, the default), bytes, or an open byte stream. */
  read(path: string, options?: { format?: "text" }): Promise<string>;
  read(path: string, options: { format: "bytes" }): Promise<Uint8Array>;
  read(path: string, options: { format: "stream" }): Promise<ReadableStream<Uint8Array>>;
  async read(path: string, options: { format?: "text" | "bytes" | "stream" } = {}):
    Promise<string | Uint8Array | ReadableStream<Uint8Array>> {
    const resp = await this.open(path);
    const format = options.format ?? "text";
    if (format === "stream") return resp.body ?? new ReadableStream<Uint8Array>({ start: (c) => c.close() });
    try {
      if (format === "bytes") return new Uint8Array(await resp.arrayBuffer());
      return await resp.text();
    } catch (exc) {
      throw mapFetchError(`read ${path}`, exc);
    }
  }

  private async open(path: string): Promise<Response> {
    const resp = await this.t.send(calls.readFile(this.sandboxId, path));
    if (isJson(resp)) {
      await resp.body?.cancel();
      throw new InvalidArgumentError(`${path} is a directory`, { status: 400, code: "is_a_directory" });
    }
    return resp;
  }

  /** The entries of a directory, sorted by name. */
  async list(path: string = calls.HOME): Promise<FileInfo[]> {
    const resp = await this.t.send(calls.readFile(this.sandboxId, path));
    if (!isJson(resp)) {
      await resp.body?.cancel();
      throw new InvalidArgumentError(`${path} is not a directory`, { status: 400, code: "not_a_directory" });
    }
    const data = (await resp.json()) as { entries?: unknown[] };
    return (data.entries ?? []).map(parseFileInfo);
  }

  /** A file's or directory's type, size, mode and mtime ({@link NotFoundError} if missing). */
  async stat(path: string): Promise<FileInfo> {
    return parseFileInfo(await this.t.json(calls.statFile(this.sandboxId, path)));
  }

  async exists(path: string): Promise<boolean> {
    try {
      await this.stat(path);
      return true;
    } catch (exc) {
      if (exc instanceof NotFoundError && exc.code === "not_found" && !(exc instanceof SandboxNotFoundError)) {
        return false;
      }
      throw exc;
    }
  }

  /** Delete a file, or a directory with everything in it. */
  async remove(path: string): Promise<void> {
    await this.t.discard(calls.deleteFile(this.sandboxId, path));
  }

  /** Create a directory and its parents; false if it already existed. */
  async makeDir(path: string): Promise<boolean> {
    const p = `'${calls.sandboxPath(path).replaceAll("'", "'\\''")}'`;
    const command = `if [ -d ${p} ]; then exit 3; fi; mkdir -p -- ${p}`;
    const res = await this.t.json<{ exit_code?: number; stderr?: string }>(
      calls.execute(this.sandboxId, { command, timeout: 30 }));
    const code = Number(res?.exit_code ?? 1);
    if (code !== 0 && code !== 3) {
      throw new InvalidArgumentError(`cannot create ${path}: ${(res?.stderr ?? "").trim()}`,
        { status: 400, code: "mkdir_failed" });
    }
    return code === 0;
  }

  /** Stream a sandbox file into the local file `dest`; returns `dest`. */
  async download(path: string, dest: string, options: TransferOptions = {}): Promise<string> {
    const resp = await this.open(path);
    const length = resp.headers.get("content-length");
    const total = length === null ? undefined : Number(length);
    let body = resp.body ?? new ReadableStream<Uint8Array>({ start: (c) => c.close() });
    if (options.onProgress) body = counted(body, total, options.onProgress);
    try {
      await body.pipeTo(Writable.toWeb(createWriteStream(dest)) as WritableStream<Uint8Array>);
    } catch (exc) {
      throw mapFetchError(`download ${path}`, exc);
    }
    return dest;
  }
}
