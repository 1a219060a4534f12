/**
 * The SDK against a scripted fake server (no VMs): request shapes, error mapping, NDJSON
 * streams (cut short, reattached), uploads, tools. Runs in about a second.
 */

import assert from "node:assert/strict";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import * as ai from "ai";

import {
  AgentBox, APIConnectionError, AuthenticationError, ConfigurationError, ConflictError,
  ERROR_CODES, EndpointNotFoundError, InvalidArgumentError, NotFoundError, QuotaExceededError,
  RateLimitError, SandboxError, SandboxNotFoundError, ServerError, StorageFullError,
  StreamInterruptedError, TimeoutError, UnavailableError, errorFromResponse, openaiTools,
  openaiResponsesTools, anthropicTools, vercelTools, ToolDispatcher, TOOL_NAMES, type Sandbox,
} from "@agentbox/sdk";

import { SANDBOX, json, ndjson, startFake, type Fake } from "./fake.js";

let fake: Fake;
let box: AgentBox;
let sandbox: Sandbox;

before(async () => {
  fake = await startFake();
  fake.route("POST /v1/sandboxes", (_req, res) => json(res, 201, SANDBOX));
  fake.route("GET /v1/info", (_req, res) => json(res, 200, {
    version: "0.1.0", preview_url_template: "http://{port}-{id}.preview.test:9000",
    session_url_template: "http://{name}.s.test:9000" }));
  box = new AgentBox({ apiKey: "k1", baseUrl: `${fake.url}/` });
  sandbox = await box.create({ environment: "python", idleTimeout: 60, metadata: { u: 1 } });
});

after(async () => {
  await fake.close();
});

describe("configuration", () => {
  test("no key anywhere is a ConfigurationError", () => {
    const saved = process.env.AGENTBOX_API_KEY;
    delete process.env.AGENTBOX_API_KEY;
    try {
      assert.throws(() => new AgentBox({ baseUrl: fake.url }), ConfigurationError);
    } finally {
      if (saved !== undefined) process.env.AGENTBOX_API_KEY = saved;
    }
  });

  test("the environment gives key and URL; a URL without a scheme gets http://", () => {
    const saved = { ...process.env };
    process.env.AGENTBOX_API_KEY = "envkey";
    process.env.AGENTBOX_URL = "example.test:1234";
    try {
      const client = new AgentBox();
      assert.equal(client.config.apiKey, "envkey");
      assert.equal(client.config.baseUrl, "http://example.test:1234");
    } finally {
      process.env = saved;
    }
  });

  test("create sends the key, snake_case fields and tolerates unknown answer fields", () => {
    const req = fake.seen.find((s) => s.method === "POST" && s.path === "/v1/sandboxes")!;
    assert.equal(req.headers.authorization, "Bearer k1");
    assert.deepEqual(JSON.parse(req.body.toString()), { template: "python", idle_timeout: 60, metadata: { u: 1 } });
    assert.equal(sandbox.id, "sb1");
    assert.equal(sandbox.sandboxId, "sb1");
    assert.equal(sandbox.info.idleTimeout, 300);
  });

  test("template and environment that disagree are refused before any request", async () => {
    await assert.rejects(box.create({ template: "a", environment: "b" }), InvalidArgumentError);
  });
});

describe("errors", () => {
  test("every documented code maps to its class, with status, code and Retry-After", () => {
    assert.ok(ERROR_CODES.size >= 55, String(ERROR_CODES.size));
    const e = errorFromResponse(409, JSON.stringify({ error: { code: "quota_exceeded", message: "max 2" } }), "3");
    assert.ok(e instanceof QuotaExceededError && e instanceof ConflictError);
    assert.equal(e.status, 409);
    assert.equal(e.code, "quota_exceeded");
    assert.equal(e.message, "max 2");
    assert.equal(e.retryAfter, 3);
    const cases: Array<[number, string, Function]> = [
      [401, "invalid_api_key", AuthenticationError], [404, "no_route", EndpointNotFoundError],
      [405, "method_not_allowed", EndpointNotFoundError], [404, "not_found", NotFoundError],
      [429, "rate_limited", RateLimitError], [502, "agent_unreachable", SandboxError],
      [503, "sandbox_crashed", UnavailableError], [504, "wake_timeout", TimeoutError],
      [507, "no_space", StorageFullError], [500, "internal", ServerError],
    ];
    for (const [status, code, cls] of cases) {
      const err = errorFromResponse(status, JSON.stringify({ error: { code, message: "m" } }));
      assert.ok(err instanceof cls, `${code} -> ${err.name}`);
    }
  });

  test("every code in docs/api.md's error table is mapped, to a class of its status family", async (t) => {
    const doc = new URL("../../../docs/api.md", import.meta.url);
    let text: string;
    try {
      text = await readFile(doc, "utf8");
    } catch {
      return t.skip("docs/api.md is not here (the SDK outside its repository)");
    }
    const table = text.split("## Error codes")[1] ?? "";
    let rows = 0;
    for (const line of table.split("\n")) {
      const row = /^\| (\d{3}) \| (.*?) \| /.exec(line);
      if (!row) continue;
      rows += 1;
      const status = Number(row[1]);
      for (const [, code] of row[2]!.matchAll(/`([a-z_]+)`/g)) {
        assert.ok(ERROR_CODES.has(code!), `${code} (${status}) is not in ERROR_CODES`);
        const err = errorFromResponse(status, JSON.stringify({ error: { code, message: "m" } }));
        assert.equal(Math.floor(err.status / 100), Math.floor(status / 100));
        assert.equal(err.code, code);
      }
    }
    assert.ok(rows >= 10, `only ${rows} rows read from the table`);
  });

  test("an unknown code falls back to its status family; a non-JSON body is kept", () => {
    const e = errorFromResponse(409, JSON.stringify({ error: { code: "brand_new", message: "m" } }));
    assert.ok(e instanceof ConflictError);
    assert.equal(e.code, "brand_new");
    const html = errorFromResponse(502, "<html>bad gateway</html>");
    assert.ok(html instanceof SandboxError);
    assert.match(html.message, /HTTP 502: <html>/);
  });

  test("an API error answer becomes the typed error", async () => {
    fake.route("GET /v1/sandboxes/gone", (_req, res) =>
      json(res, 404, { error: { code: "sandbox_not_found", message: "no sandbox gone" } }));
    fake.route("DELETE /v1/sandboxes/gone", (_req, res) =>
      json(res, 404, { error: { code: "sandbox_not_found", message: "no sandbox gone" } }));
    await assert.rejects(box.get("gone"), (exc: unknown) =>
      exc instanceof SandboxNotFoundError && exc.status === 404 && exc.message === "no sandbox gone");
    assert.equal(await box.kill("gone"), false);
  });

  test("a refused connection is an APIConnectionError; our timeout a TimeoutError", async () => {
    const dead = new AgentBox({ apiKey: "k", baseUrl: "http://127.0.0.1:1" });
    await assert.rejects(dead.list(), APIConnectionError);
    fake.route("GET /v1/templates", (_req, res) => { setTimeout(() => json(res, 200, { templates: [] }), 1000); });
    const slow = new AgentBox({ apiKey: "k", baseUrl: fake.url, timeout: 0.2 });
    await assert.rejects(slow.templates(), TimeoutError);
  });
});

describe("execute and runCode", () => {
  test("execute sends code or command, relative cwd under /root; parses the Python error", async () => {
    fake.route("POST /v1/sandboxes/sb1/execute", (_req, res) => json(res, 200, {
      stdout: "", stderr: "Traceback...\nZeroDivisionError: division by zero\n", exit_code: 1,
      duration_ms: 5, timed_out: false, truncated: false }));
    const res = await sandbox.execute("1/0", { cwd: "work", env: { A: "1" } });
    assert.deepEqual(JSON.parse(fake.seen.at(-1)!.body.toString()),
      { code: "1/0", language: "python", cwd: "/root/work", env: { A: "1" } });
    assert.equal(res.ok, false);
    assert.equal(res.error?.name, "ZeroDivisionError");
    assert.equal(res.error?.value, "division by zero");
    await sandbox.execute({ command: "ls", timeout: 5 });
    assert.deepEqual(JSON.parse(fake.seen.at(-1)!.body.toString()), { command: "ls", timeout: 5 });
  });

  test("a streamed run calls back in order and assembles the Execution", async () => {
    fake.route("POST /v1/sandboxes/sb1/run_code", (_req, res) => ndjson(res, [
      { type: "stdout", data: "a\n" }, { type: "stderr", data: "w\n" },
      { type: "result", result: { "text/plain": "42", is_main_result: true } },
      { type: "brand_new_event" },
      { type: "end", execution_count: 3, duration_ms: 7 }]));
    const seen: string[] = [];
    const ex = await sandbox.runCode("x", {
      onStdout: (d) => { seen.push(`out:${d}`); },
      onStderr: async (d) => { seen.push(`err:${d}`); },
      onResult: (r) => { seen.push(`result:${r.text}`); },
    });
    assert.deepEqual(seen, ["out:a\n", "err:w\n", "result:42"]);
    assert.equal(JSON.parse(fake.seen.at(-1)!.body.toString()).stream, true);
    assert.equal(ex.text, "42");
    assert.equal(ex.stdout, "a\n");
    assert.equal(ex.executionCount, 3);
  });

  test("a stream that ends without its 'end' line is a StreamInterruptedError", async () => {
    fake.route("POST /v1/sandboxes/sb1/run_code", (_req, res) => ndjson(res, [{ type: "stdout", data: "a" }]));
    await assert.rejects(sandbox.runCode("x", { stream: true }), StreamInterruptedError);
  });
});

describe("commands", () => {
  test("a background handle reattaches from the last offset when its stream breaks", async () => {
    fake.route("POST /v1/sandboxes/sb1/commands", (_req, res) => json(res, 201, {
      pid: 7, command: "x", cwd: "/root", background: true, stdin: false, running: true,
      exit_code: null, started_at: 1, finished_at: null, timed_out: false, output_bytes: 0 }));
    let calls = 0;
    fake.route("GET /v1/sandboxes/sb1/commands/7/output", (req, res) => {
      calls += 1;
      if (calls === 1) {
        ndjson(res, [{ type: "stdout", data: "one\n", offset: 0, next_offset: 4 }], false);
        setTimeout(() => res.socket?.destroy(), 20); // the connection breaks mid-stream
        return;
      }
      assert.equal(req.query.get("offset"), "4");
      ndjson(res, [{ type: "stdout", data: "two\n", offset: 4, next_offset: 8 },
                   { type: "exit", exit_code: 0, timed_out: false }]);
    });
    const handle = await sandbox.commands.run("x", { background: true });
    const chunks: string[] = [];
    for await (const chunk of handle) chunks.push(chunk.data);
    assert.deepEqual(chunks, ["one\n", "two\n"]);
    assert.equal(handle.exitCode, 0);
    assert.equal(handle.offset, 8);
    assert.equal(calls, 2);
    const result = await handle.wait();
    assert.equal(result.stdout, "one\ntwo\n");
  });

  test("kill of a finished command is false; stdin goes raw with ?eof=1", async () => {
    fake.route("POST /v1/sandboxes/sb1/commands/7/signal", (_req, res) =>
      json(res, 409, { error: { code: "not_running", message: "exited" } }));
    fake.route("POST /v1/sandboxes/sb1/commands/7/stdin", (_req, res) => { res.writeHead(204); res.end(); });
    assert.equal(await sandbox.commands.kill(7), false);
    await sandbox.commands.sendStdin(7, "hi", { eof: true });
    const req = fake.seen.at(-1)!;
    assert.equal(req.query.get("eof"), "1");
    assert.equal(req.body.toString(), "hi");
  });
});

describe("files", () => {
  test("a streamed upload arrives whole, reports progress, and uses ?path=", async () => {
    fake.route("POST /v1/sandboxes/sb1/files", (req, res) => json(res, 201, {
      path: req.query.get("path"), name: "f", type: "file", size: req.body.length, mode: 420, mtime: 1 }));
    async function* parts(): AsyncGenerator<Uint8Array> {
      for (let i = 0; i < 4; i++) yield new Uint8Array(100_000).fill(i);
    }
    const progress: number[] = [];
    const info = await sandbox.files.write("data/f.bin", parts(), { onProgress: (done) => progress.push(done) });
    assert.equal(info.path, "/root/data/f.bin");
    assert.equal(info.size, 400_000);
    assert.equal(progress.at(-1), 400_000);
  });

  test("a local file uploads with its Content-Length and downloads back to disk", async () => {
    const dir = await mkdtemp(join(tmpdir(), "agentbox-ts-"));
    const src = join(dir, "src.bin");
    await writeFile(src, Buffer.alloc(300_000, 7));
    let stored: Buffer = Buffer.alloc(0);
    fake.route("POST /v1/sandboxes/sb1/files", (req, res) => {
      assert.equal(req.headers["content-length"], "300000");
      stored = req.body;
      json(res, 201, { path: req.query.get("path"), name: "b", type: "file", size: req.body.length, mode: 420, mtime: 1 });
    });
    fake.route("GET /v1/sandboxes/sb1/files/tmp/b.bin", (_req, res) => {
      res.writeHead(200, { "Content-Type": "application/octet-stream", "Content-Length": String(stored.length) });
      res.end(stored);
    });
    const info = await sandbox.files.upload("/tmp/b.bin", src);
    assert.equal(info.size, 300_000);
    const seen: Array<number | undefined> = [];
    const dest = await sandbox.download("/tmp/b.bin", join(dir, "back.bin"), { onProgress: (_d, total) => seen.push(total) });
    assert.deepEqual(await readFile(dest), await readFile(src));
    assert.equal(seen.at(-1), 300_000);
    await rm(dir, { recursive: true });
  });

  test("reading a directory is is_a_directory; listing a file not_a_directory", async () => {
    fake.route("GET /v1/sandboxes/sb1/files/root/d", (_req, res) => json(res, 200, { path: "/root/d", entries: [] }));
    fake.route("GET /v1/sandboxes/sb1/files/root/f%20x", (_req, res) => { res.writeHead(200, { "Content-Type": "application/octet-stream" }); res.end("abc"); });
    await assert.rejects(sandbox.files.read("/root/d"), (e: unknown) => e instanceof InvalidArgumentError && e.code === "is_a_directory");
    await assert.rejects(sandbox.files.list("f x"), (e: unknown) => e instanceof InvalidArgumentError && e.code === "not_a_directory");
    assert.equal(await sandbox.files.read("f x"), "abc");
    assert.deepEqual(await sandbox.files.list("/root/d"), []);
  });
});

describe("preview and sessions", () => {
  test("URLs come from the server's templates", async () => {
    fake.route("GET /v1/sandboxes/sb1/preview", (_req, res) => json(res, 200, {
      preview_token: "pv_x", public_ports: [], preview_url_template: "" }));
    assert.equal(await sandbox.getUrl(8000), "http://8000-sb1.preview.test:9000");
    assert.equal(await sandbox.getUrl(8000, { withToken: true }), "http://8000-sb1.preview.test:9000/?token=pv_x");
    assert.equal(await sandbox.getHost(3000), "3000-sb1.preview.test:9000");
    await assert.rejects(sandbox.getUrl(0), InvalidArgumentError);
    fake.route("PUT /v1/sessions/app", (_req, res) => json(res, 201, {
      name: "app", sandbox_id: "sb1", state: "running", port: 8000, url: "http://app.sessions.localhost",
      start_state: "started" }));
    const s = await box.sessions.put("app", { port: 8000, start: "x" });
    assert.equal(s.url, "http://app.s.test:9000");
    assert.equal(s.startState, "started");
    assert.equal(JSON.parse(JSON.stringify(s)).client, undefined);
  });
});

describe("terminal", () => {
  test("a refused upgrade is the typed error of its answer; the key goes as a header", async () => {
    fake.route("GET /v1/sandboxes/sb1/terminal", (_req, res) =>
      json(res, 503, { error: { code: "sandbox_limit", message: "full" } }, { "Retry-After": "2" }));
    await assert.rejects(sandbox.terminal({ cols: 100, rows: 30 }), (e: unknown) =>
      e instanceof UnavailableError && e.code === "sandbox_limit" && e.retryAfter === 2);
    const req = fake.seen.at(-1)!;
    assert.equal(req.headers.authorization, "Bearer k1");
    assert.equal(req.query.get("cols"), "100");
    assert.equal(sandbox.terminalUrl(), `${fake.url.replace("http", "ws")}/v1/sandboxes/sb1/terminal`);
  });
});

describe("tools", () => {
  test("OpenAI, Responses and Anthropic shapes carry the five tools", () => {
    assert.deepEqual(openaiTools().map((t) => t.function.name), [...TOOL_NAMES]);
    assert.equal(openaiResponsesTools(["run_code"])[0]!.name, "run_code");
    assert.equal(anthropicTools()[1]!.input_schema.type, "object");
    assert.throws(() => openaiTools(["nope"]), /unknown tool/);
  });

  test("the dispatcher answers bad calls and API errors as error results", async () => {
    const dispatch = new ToolDispatcher(sandbox);
    const bad = await dispatch.openai({ id: "c1", function: { name: "read_file", arguments: "{not json" } });
    assert.equal(bad.tool_call_id, "c1");
    assert.match(bad.content, /not valid JSON/);
    fake.route("GET /v1/sandboxes/sb1/files/root/missing", (_req, res) =>
      json(res, 404, { error: { code: "not_found", message: "no such file" } }));
    const out = await dispatch.call("read_file", { path: "missing" });
    assert.equal(out.isError, true);
    assert.match(out.text, /no such file \[not_found\]/);
    const block = await dispatch.anthropic({ id: "u1", name: "nope", input: {} });
    assert.equal(block.is_error, true);
  });

  test("Vercel AI SDK tools are built with the caller's ai module", () => {
    const tools = vercelTools(sandbox, ai) as Record<string, { inputSchema: { jsonSchema: unknown }; execute: unknown }>;
    assert.deepEqual(Object.keys(tools), [...TOOL_NAMES]);
    assert.equal(typeof tools.run_code!.execute, "function");
    assert.deepEqual((tools.run_code!.inputSchema.jsonSchema as { required: string[] }).required, ["code"]);
  });
});
