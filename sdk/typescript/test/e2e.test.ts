/**
 * The SDK against a live AgentBox daemon with real microVMs. It starts nothing itself: it reads
 * AGENTBOX_URL and AGENTBOX_API_KEY (an admin key) from the environment, and skips, saying so,
 * when they are not set. tests/e2e/test_typescript_sdk.py runs it against the e2e daemon.
 * Every sandbox and session it makes is deleted at the end.
 */

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { request } from "node:http";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import * as ai from "ai";
import { MockLanguageModelV3 } from "ai/test";

import {
  AgentBox, AuthenticationError, InvalidArgumentError, NotFoundError, Sandbox,
  SandboxNotFoundError, SessionNotFoundError, TemplateNotFoundError, ToolDispatcher,
  openaiTools, vercelTools, type Result,
} from "@agentbox/sdk";

const URL_ = process.env.AGENTBOX_URL;
const KEY = process.env.AGENTBOX_API_KEY;
const skip = !URL_ || !KEY ? "AGENTBOX_URL and AGENTBOX_API_KEY are not set (no live daemon)" : false;

let box: AgentBox;
let shared: Sandbox;
const made: string[] = [];
const sessions: string[] = [];
const suffix = randomBytes(3).toString("hex");

async function fresh(): Promise<Sandbox> {
  const sandbox = await box.create({ template: "python" });
  made.push(sandbox.id);
  return sandbox;
}

/** GET through the daemon with a preview Host header (fetch may not set Host). */
function previewGet(host: string, headers: Record<string, string> = {}):
  Promise<{ status: number; body: string }> {
  const base = new URL(URL_!);
  return new Promise((resolve, reject) => {
    const req = request({ host: base.hostname, port: base.port, path: "/", headers: { Host: host, ...headers } }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (d: string) => { body += d; });
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
    });
    req.on("error", reject);
    req.end();
  });
}

describe("TypeScript SDK against a live daemon", { skip }, () => {
  before(async () => {
    box = new AgentBox({ apiKey: KEY!, baseUrl: URL_! });
    shared = await fresh();
  });

  after(async () => {
    for (const name of sessions) await box.sessions.delete(name).catch(() => undefined);
    for (const id of made) await box.kill(id).catch(() => undefined);
  });

  test("seed example: create, execute, print", async () => {
    const client = new AgentBox(); // from AGENTBOX_API_KEY / AGENTBOX_URL
    const sandbox = await client.create({ environment: "python" });
    made.push(sandbox.id);
    const result = await sandbox.execute("print(1)");
    assert.equal(result.stdout, "1\n");
    assert.equal(result.exitCode, 0);
    assert.ok(result.ok);
    await sandbox.kill();
  });

  test("create, connect, list, kill; a killed sandbox is SandboxNotFoundError", async () => {
    const sandbox = await Sandbox.create({ apiKey: KEY, baseUrl: URL_, metadata: { who: "ts" }, idleTimeout: 120 });
    made.push(sandbox.id);
    assert.equal(sandbox.state, "running");
    assert.deepEqual(sandbox.info.metadata, { who: "ts" });
    const again = await Sandbox.connect(sandbox.id, { apiKey: KEY, baseUrl: URL_ });
    assert.equal(again.id, sandbox.id);
    assert.match(again.info.previewToken ?? "", /^pv_/); // the owner's view (get) carries it
    assert.ok(again.info.previewUrlTemplate?.includes(sandbox.id));
    assert.ok((await box.list()).some((s) => s.id === sandbox.id));
    assert.ok(await sandbox.isRunning());
    assert.equal(await sandbox.kill(), true);
    assert.equal(await sandbox.kill(), false);
    await assert.rejects(box.get(sandbox.id), SandboxNotFoundError);
    assert.ok((await box.templates()).some((t) => t.name === "python"));
  });

  test("await using kills a created sandbox at the end of the block, not a connected one", async () => {
    let id = "";
    {
      await using sandbox = await box.create();
      id = sandbox.id;
      made.push(id);
      {
        await using connected = await box.connect(id);
        assert.equal(connected.id, id);
      }
      assert.equal((await box.get(id)).state, "running");
    }
    await assert.rejects(box.get(id), SandboxNotFoundError);
  });

  test("execute: code, commands with env and cwd, Python errors, timeouts", async () => {
    const err = await shared.execute("import sys; print('out'); print('err', file=sys.stderr); 1/0");
    assert.equal(err.stdout, "out\n");
    assert.match(err.stderr, /err\n/);
    assert.equal(err.error?.name, "ZeroDivisionError");
    const cmd = await shared.execute({ command: "mkdir -p /root/w && cd /root/w && pwd && echo $FOO", env: { FOO: "bar" } });
    assert.equal(cmd.stdout, "/root/w\nbar\n");
    const cwd = await shared.execute({ command: "pwd", cwd: "w" });
    assert.equal(cwd.stdout, "/root/w\n");
    const slow = await shared.execute({ command: "sleep 10", timeout: 1 });
    assert.equal(slow.timedOut, true);
    assert.equal(slow.error?.name, "TimeoutError");
    const bash = await shared.execute("echo $((6*7))", { language: "bash" });
    assert.equal(bash.stdout, "42\n");
  });

  test("runCode: state persists, output streams, rich results, errors, contexts", async () => {
    await shared.runCode("x = 41");
    const ex = await shared.runCode("x + 1");
    assert.equal(ex.text, "42");
    const chunks: string[] = [];
    const results: Result[] = [];
    const streamed = await shared.runCode(
      "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.05)\n"
      + "class R:\n    def _repr_html_(self): return '<b>hi</b>'\n    def _repr_png_(self): return "
      + "b'\\x89PNG\\r\\n\\x1a\\n'\n    def __repr__(self): return 'R()'\ndisplay(R())\nR()",
      { onStdout: (d) => { chunks.push(d); }, onResult: (r) => { results.push(r); } });
    assert.equal(chunks.join(""), "0\n1\n2\n");
    assert.ok(chunks.length >= 2, `streamed in ${chunks.length} chunk(s)`);
    assert.equal(results.length, 2);
    assert.equal(streamed.results.length, 2);
    const main = streamed.results.find((r) => r.isMainResult)!;
    assert.equal(main.html, "<b>hi</b>");
    assert.equal(main.text, "R()");
    assert.deepEqual([...main.imageBytes()!.slice(0, 4)], [0x89, 0x50, 0x4e, 0x47]);
    const failed = await shared.runCode("raise ValueError('nope')", { onStderr: () => undefined });
    assert.equal(failed.error?.name, "ValueError");
    assert.equal(failed.error?.value, "nope");
    assert.match(failed.error!.traceback, /ValueError: nope/);
    const events: string[] = [];
    for await (const event of shared.runCodeEvents("print('e')")) events.push(String(event.type));
    assert.deepEqual(events.filter((t) => t !== "stderr"), ["stdout", "end"]);
    const ctx = await shared.createCodeContext({ name: `c${suffix}`, cwd: "/tmp" });
    assert.equal((await shared.runCode("import os; os.getcwd()", { context: ctx })).text, "'/tmp'");
    assert.equal((await shared.runCode("'x' in globals()", { context: ctx })).text, "False");
    assert.ok((await shared.listCodeContexts()).some((c) => c.name === ctx.name));
    await shared.removeCodeContext(ctx);
    assert.ok(!(await shared.listCodeContexts()).some((c) => c.name === ctx.name));
  });

  test("commands: foreground streaming, background with stdin, reattach by offset, kill", async () => {
    const out: string[] = [];
    const fg = await shared.commands.run("echo a; echo b >&2; exit 3", { onStdout: (d) => { out.push(d); } });
    assert.equal(fg.exitCode, 3);
    assert.equal(fg.stdout, "a\n");
    assert.equal(fg.stderr, "b\n");
    assert.equal(out.join(""), "a\n");

    const cat = await shared.commands.run("cat | tr a-z A-Z", { background: true, stdin: true });
    await cat.sendStdin("hello ");
    await cat.sendStdin(new TextEncoder().encode("world"));
    await cat.closeStdin();
    const upper = await cat.wait({ timeout: 30 });
    assert.equal(upper.stdout, "HELLO WORLD");
    assert.equal(upper.exitCode, 0);

    const counter = await shared.commands.run("for i in 1 2 3 4; do echo line$i; sleep 0.3; done",
      { background: true });
    let first = "";
    for await (const chunk of counter) {
      first = chunk.data;
      break; // leave the stream: the command keeps running in the sandbox
    }
    assert.equal(first, "line1\n");
    const offset = counter.offset;
    assert.equal(offset, 6);
    const again = await shared.commands.connect(counter.pid, { offset });
    const rest = await again.wait({ timeout: 30 });
    assert.equal(rest.stdout, "line2\nline3\nline4\n");
    const whole = await (await shared.commands.connect(counter.pid)).wait();
    assert.equal(whole.stdout, "line1\nline2\nline3\nline4\n");
    assert.ok((await shared.commands.list()).some((p) => p.pid === counter.pid && !p.running));

    const sleeper = await shared.commands.run("sleep 60", { background: true });
    assert.equal((await sleeper.info()).running, true);
    assert.equal(await sleeper.kill(), true);
    const killed = await sleeper.wait({ timeout: 30 });
    assert.equal(killed.exitCode, -9);
    assert.equal(await sleeper.kill(), false);
  });

  test("terminal: keys in, output and exit code out", async () => {
    let output = "";
    const term = await shared.terminal({ cols: 100, rows: 30, onData: (d) => { output += Buffer.from(d).toString(); } });
    term.resize(120, 40);
    term.write("echo $((40+2)); stty size; exit 3\n");
    assert.equal(await term.exited, 3);
    assert.match(output, /42/);
    assert.match(output, /40 120/);
  });

  test("files: write, read, list, stat, exists, remove, makeDir, upload and download", async () => {
    const info = await shared.files.write("dir/a.txt", "héllo\n");
    assert.equal(info.path, "/root/dir/a.txt");
    assert.equal(info.size, 7);
    assert.equal(await shared.files.read("/root/dir/a.txt"), "héllo\n");
    const bin = new Uint8Array(256).map((_, i) => i);
    await shared.upload("/root/dir/b.bin", bin);
    assert.deepEqual(await shared.download("/root/dir/b.bin"), bin);
    assert.deepEqual((await shared.files.list("dir")).map((e) => e.name), ["a.txt", "b.bin"]);
    const st = await shared.files.stat("dir");
    assert.equal(st.isDir, true);
    assert.equal(await shared.files.exists("dir/none"), false);
    await assert.rejects(shared.files.read("dir/none"), (e: unknown) => e instanceof NotFoundError && e.code === "not_found");
    await assert.rejects(shared.files.read("dir"), (e: unknown) => e instanceof InvalidArgumentError && e.code === "is_a_directory");
    assert.equal(await shared.files.makeDir("made/deep"), true);
    assert.equal(await shared.files.makeDir("made/deep"), false);
    await shared.files.remove("dir");
    assert.equal(await shared.files.exists("dir/a.txt"), false);

    const local = await mkdtemp(join(tmpdir(), "agentbox-ts-e2e-"));
    try {
      const big = randomBytes(3 * 1024 * 1024);
      await writeFile(join(local, "big.bin"), big);
      let sent = 0;
      const up = await shared.files.upload("/tmp/big.bin", join(local, "big.bin"), { onProgress: (d) => { sent = d; } });
      assert.equal(up.size, big.length);
      assert.equal(sent, big.length);
      const stream = await shared.files.read("/tmp/big.bin", { format: "stream" });
      let streamed = 0;
      for await (const chunk of stream) streamed += chunk.byteLength;
      assert.equal(streamed, big.length);
      await shared.download("/tmp/big.bin", join(local, "back.bin"));
      assert.ok((await readFile(join(local, "back.bin"))).equals(big));
    } finally {
      await rm(local, { recursive: true });
    }
  });

  test("preview: URL, token, rotation, public ports", async () => {
    const sandbox = await fresh();
    await sandbox.commands.run("cd /tmp && echo preview-ok > index.html && python3 -m http.server 8000",
      { background: true });
    const host = await sandbox.getHost(8000);
    assert.ok(host.startsWith(`8000-${sandbox.id}.`), host);
    const token = await sandbox.previewToken();
    assert.match(token, /^pv_/);
    assert.ok((await sandbox.getUrl(8000, { withToken: true })).includes(`token=${token}`));
    assert.equal((await previewGet(host)).status, 401);
    let page = { status: 0, body: "" };
    for (let i = 0; i < 50 && page.status !== 200; i++) {
      page = await previewGet(host, { "X-AgentBox-Token": token });
      if (page.status !== 200) await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(page.status, 200);
    assert.equal(page.body, "preview-ok\n");
    const rotated = await sandbox.rotatePreviewToken();
    assert.notEqual(rotated, token);
    assert.equal((await previewGet(host, { "X-AgentBox-Token": token })).status, 401);
    assert.equal((await previewGet(host, { "X-AgentBox-Token": rotated })).status, 200);
    assert.deepEqual((await sandbox.setPublicPorts([8000])).publicPorts, [8000]);
    assert.equal((await previewGet(host)).status, 200);
    assert.deepEqual((await sandbox.getPreview()).publicPorts, [8000]);
    await sandbox.update({ publicPorts: [] });
    assert.equal((await previewGet(host)).status, 401);
    await sandbox.kill();
  });

  test("sessions: put (idempotent), get, list, sandbox(), delete", async () => {
    const name = `ts-${suffix}`;
    sessions.push(name);
    const s = await box.sessions.put(name, { template: "python", port: 8000, start: "sleep 300" });
    assert.equal(s.name, name);
    assert.equal(s.port, 8000);
    assert.ok(s.url.includes(name), s.url);
    assert.ok(s.sandboxId);
    const same = await box.sessions.put(name, { port: 9999 });
    assert.equal(same.sandboxId, s.sandboxId);
    assert.equal(same.port, 8000);
    assert.equal((await box.sessions.get(name)).sandboxId, s.sandboxId);
    assert.ok((await box.sessions.list()).some((x) => x.name === name));
    const sandbox = await s.sandbox();
    assert.equal((await sandbox.execute("print('in session')")).stdout, "in session\n");
    assert.equal(await box.sessions.delete(name), true);
    assert.equal(await box.sessions.delete(name), false);
    await assert.rejects(box.sessions.get(name), SessionNotFoundError);
  });

  test("suspend and resume; a request to a suspended sandbox wakes it", async () => {
    const sandbox = await fresh();
    await sandbox.runCode("kept = 'alive'");
    assert.equal((await sandbox.suspend()).state, "suspended");
    assert.equal((await sandbox.getInfo()).state, "suspended");
    assert.equal((await sandbox.runCode("kept")).text, "'alive'");
    assert.equal((await sandbox.getInfo()).state, "running");
    await sandbox.pause();
    assert.equal((await sandbox.resume()).state, "running");
    assert.equal((await sandbox.execute({ command: "echo up" })).stdout, "up\n");
    assert.ok((await sandbox.getInfo()).restoreCount >= 2);
    await sandbox.kill();
  });

  test("typed errors from the server's codes", async () => {
    const bad = new AgentBox({ apiKey: "not-a-key", baseUrl: URL_ });
    await assert.rejects(bad.list(), (e: unknown) => e instanceof AuthenticationError && e.status === 401);
    await assert.rejects(box.create({ template: "no-such-template" }), TemplateNotFoundError);
    await assert.rejects(shared.execute({ command: "true", timeout: "soon" as unknown as number }),
      (e: unknown) => e instanceof InvalidArgumentError && e.status === 400);
    await assert.rejects(box.create({ idleTimeout: -1 }),
      (e: unknown) => e instanceof InvalidArgumentError && e.code === "bad_request");
    await assert.rejects(box.connect("nope"), SandboxNotFoundError);
  });

  test("tools: the OpenAI dispatcher runs each tool in the sandbox", async () => {
    const dispatch = new ToolDispatcher(shared);
    assert.equal(openaiTools().length, 5);
    const wrote = await dispatch.openai({ id: "1", function: { name: "write_file", arguments: JSON.stringify({ path: "t/n.txt", content: "hi" }) } });
    assert.equal(wrote.content, "wrote 2 bytes to /root/t/n.txt");
    assert.equal((await dispatch.call("read_file", { path: "t/n.txt" })).text, "hi");
    assert.match((await dispatch.call("list_files", { path: "t" })).text, /n\.txt/);
    const cmd = await dispatch.call("run_command", { command: "echo $((2+3))" });
    assert.equal(cmd.text, "exit_code: 0\nstdout:\n5\n");
    const code = await dispatch.call("run_code", { code: "21 * 2" });
    assert.match(code.text, /result:\n42/);
    const failed = await dispatch.call("run_command", { command: "exit 4" });
    assert.equal(failed.isError, true);
  });

  test("tools: Vercel AI SDK generateText runs a model's tool call in the sandbox", async () => {
    let step = 0;
    const model = new MockLanguageModelV3({
      doGenerate: async () => {
        step += 1;
        const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 },
                        outputTokens: { total: 1, text: 1, reasoning: 0 } };
        if (step === 1) {
          return { content: [{ type: "tool-call", toolCallId: "t1", toolName: "run_code",
                               input: JSON.stringify({ code: "6 * 7" }) }],
                   finishReason: { unified: "tool-calls", raw: "tool_calls" }, usage, warnings: [] } as never;
        }
        return { content: [{ type: "text", text: "done" }], finishReason: { unified: "stop", raw: "stop" },
                 usage, warnings: [] } as never;
      },
    });
    const result = await ai.generateText({
      model, prompt: "compute", tools: vercelTools(shared, ai) as ai.ToolSet, stopWhen: ai.stepCountIs(3),
    });
    assert.equal(result.text, "done");
    const toolResults = result.steps.flatMap((s) => s.toolResults);
    assert.equal(toolResults.length, 1);
    assert.match(String(toolResults[0]!.output), /result:\n42/);
  });
});
