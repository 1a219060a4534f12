/**
 * Templates, snapshots, forks, Dockerfile builds and egress against the scripted fake server
 * (no VMs): request shapes, the context tar (read back by the system's `tar`), a build's log
 * followed to its end, a failed build, a log cut short.
 */

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdir, mkdtemp, readFile, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  AgentBox, ConflictError, InvalidArgumentError, StreamInterruptedError, TemplateBuildError,
  packContext, packFiles, tarArchive, type BuildEvent, type Sandbox,
} from "@agentbox/sdk";
import { globRegExp, skipped } from "../dist/context.js";

import { SANDBOX, json, ndjson, startFake, type Fake } from "./fake.js";

let fake: Fake;
let box: AgentBox;
let sandbox: Sandbox;
let dir: string;

const TEMPLATE = { name: "mine", owner: "tenant", source: "snapshot", state: "ready", mem_mib: 512,
                   created_at: 1, size_bytes: 10, from_sandbox: "sb1", paused_ms: 12.5, new_field: 1 };
const BUILD = { id: "b1", name: "web", state: "queued", steps: 3, step: 0, cached_steps: 0, error: null,
                created_at: 1, finished_at: null, template: null };
const body = (): unknown => JSON.parse(fake.seen.at(-1)!.body.toString());

/** The tar's members as the system's tar lists them, and its files extracted into `into`. */
function untar(tar: Uint8Array, into: string): string[] {
  execFileSync("tar", ["-xf", "-", "-C", into], { input: tar });
  return execFileSync("tar", ["-tf", "-"], { input: tar }).toString().trim().split("\n");
}

before(async () => {
  fake = await startFake();
  fake.route("POST /v1/sandboxes", (_req, res) => json(res, 201, {
    ...SANDBOX, egress: { default: "deny", allow: [], deny: [], source: "sandbox" } }));
  box = new AgentBox({ apiKey: "k1", baseUrl: fake.url });
  sandbox = await box.create({ egress: "deny_all", ttl: 60, diskMib: 2048 });
  dir = await mkdtemp(join(tmpdir(), "agentbox-ts-ctx-"));
});

after(async () => {
  await fake.close();
  await rm(dir, { recursive: true, force: true });
});

describe("egress and lifetimes", () => {
  test("create sends egress and the shape; the answer's policy is typed", () => {
    assert.deepEqual(JSON.parse(fake.seen[0]!.body.toString()),
      { template: "python", ttl: 60, egress: "deny_all", disk_mib: 2048 });
    assert.deepEqual(sandbox.info.egress, { default: "deny", allow: [], deny: [], source: "sandbox" });
  });

  test("setEgress and setTtl are PATCHes; nothing to update is refused before any request", async () => {
    fake.route("PATCH /v1/sandboxes/sb1", (req, res) => json(res, 200, {
      ...SANDBOX, egress: { ...JSON.parse(req.body.toString()).egress, source: "sandbox" } }));
    const rules = { default: "deny" as const, allow: ["pypi.org", "*.pythonhosted.org", "10.0.0.0/8"], deny: ["1.2.3.4"] };
    const info = await sandbox.setEgress(rules);
    assert.deepEqual(body(), { egress: rules });
    assert.deepEqual(info.egress?.allow, rules.allow);
    assert.equal(sandbox.info.egress?.source, "sandbox");
    await sandbox.setTtl(0);
    assert.deepEqual(body(), { ttl: 0 });
    const n = fake.seen.length;
    await assert.rejects(sandbox.update({}), InvalidArgumentError);
    assert.equal(fake.seen.length, n);
  });
});

describe("/input and /output", () => {
  test("upload's relative paths land in /input, download's come from /output; a streamed run has its files", async () => {
    fake.route("POST /v1/sandboxes/sb1/files", (req, res) => json(res, 201, {
      path: req.query.get("path"), name: "d", type: "file", size: req.body.length, mode: 420, mtime: 1 }));
    fake.route("GET /v1/sandboxes/sb1/files/output/plot.png", (_req, res) => {
      res.writeHead(200, { "Content-Type": "application/octet-stream" });
      res.end("png");
    });
    assert.equal((await sandbox.upload("data.csv", "a,b")).path, "/input/data.csv");
    assert.equal((await sandbox.upload("/tmp/x", "x")).path, "/tmp/x");
    assert.equal(new TextDecoder().decode(await sandbox.download("plot.png")), "png");
    assert.equal(new TextDecoder().decode(await sandbox.download("/output/plot.png")), "png");
    fake.route("POST /v1/sandboxes/sb1/run_code", (_req, res) => ndjson(res, [
      { type: "stdout", data: "a" }, { type: "end", files: [{ path: "/output/plot.png", size: 3 }] }]));
    const ex = await sandbox.runCode("x", { stream: true });
    assert.deepEqual(ex.files, [{ path: "/output/plot.png", size: 3 }]);
  });
});

describe("templates, snapshots and forks", () => {
  test("templates() lists; get, delete (false when gone; a built-in is a conflict)", async () => {
    fake.route("GET /v1/templates", (_req, res) => json(res, 200, { templates: [{ name: "python", default: true }, TEMPLATE] }));
    fake.route("GET /v1/templates/mine", (_req, res) => json(res, 200, TEMPLATE));
    fake.route("DELETE /v1/templates/mine", (_req, res) => { res.writeHead(204); res.end(); });
    fake.route("DELETE /v1/templates/gone", (_req, res) =>
      json(res, 404, { error: { code: "template_not_found", message: "no template gone" } }));
    fake.route("DELETE /v1/templates/python", (_req, res) =>
      json(res, 409, { error: { code: "template_builtin", message: "built-in" } }));
    assert.deepEqual((await box.templates()).map((t) => t.name), ["python", "mine"]);
    assert.deepEqual((await box.templates.list()).map((t) => t.owner), ["builtin", "tenant"]);
    const t = await box.templates.get("mine");
    assert.equal(t.source, "snapshot");
    assert.equal(t.fromSandbox, "sb1");
    assert.equal(await box.templates.delete("mine"), true);
    assert.equal(await box.templates.delete("gone"), false);
    await assert.rejects(box.templates.delete("python"), (e: unknown) => e instanceof ConflictError && e.code === "template_builtin");
    await assert.rejects(box.templates.get(""), InvalidArgumentError);
  });

  test("snapshot sends the template's name and answers the Template", async () => {
    fake.route("POST /v1/sandboxes/sb1/snapshot", (_req, res) => json(res, 201, TEMPLATE));
    const t = await sandbox.snapshot("mine");
    assert.deepEqual(body(), { template: "mine" });
    assert.equal(t.pausedMs, 12.5);
  });

  test("fork sends count and answers new Sandboxes on the same client; a bad count sends nothing", async () => {
    fake.route("POST /v1/sandboxes/sb1/fork", (_req, res) => json(res, 201, {
      sandboxes: [{ ...SANDBOX, id: "f1" }, { ...SANDBOX, id: "f2" }], next_cursor: null }));
    const forks = await sandbox.fork(2);
    assert.deepEqual(body(), { count: 2 });
    assert.deepEqual(forks.map((s) => s.id), ["f1", "f2"]);
    assert.equal(forks[0]!.client, box);
    const n = fake.seen.length;
    await assert.rejects(sandbox.fork(0), InvalidArgumentError);
    await assert.rejects(sandbox.fork(1.5), InvalidArgumentError);
    assert.equal(fake.seen.length, n);
  });
});

describe("build contexts", () => {
  test("a directory packs as tar with .dockerignore and VCS/cache directories left out", async () => {
    const ctx = join(dir, "ctx");
    await mkdir(join(ctx, "src", ".git"), { recursive: true });
    await mkdir(join(ctx, "node_modules"), { recursive: true });
    await writeFile(join(ctx, "Dockerfile"), "FROM python\nCOPY src /srv\n");
    await writeFile(join(ctx, ".dockerignore"), "# comment\n*.log\nsecret/\n");
    await writeFile(join(ctx, "src", "app.py"), "print('hi')\n");
    await writeFile(join(ctx, "src", ".git", "HEAD"), "x");
    await writeFile(join(ctx, "node_modules", "m.js"), "x");
    await writeFile(join(ctx, "debug.log"), "x");
    await mkdir(join(ctx, "secret"));
    await writeFile(join(ctx, "secret", "key"), "x");
    const long = `${"d".repeat(90)}/${"f".repeat(90)}-é.txt`;
    await mkdir(join(ctx, "d".repeat(90)));
    await writeFile(join(ctx, long), "long name");
    await symlink("src/app.py", join(ctx, "link"));
    const { tar, dockerfile } = await packContext(ctx);
    assert.equal(dockerfile, "Dockerfile");
    const out = join(dir, "out");
    await mkdir(out);
    const names = untar(tar, out);
    assert.deepEqual(names.sort(), [".dockerignore", "Dockerfile", long, "link", "src/app.py"].sort());
    assert.equal(await readFile(join(out, long), "utf8"), "long name");
    assert.equal(await readFile(join(out, "link"), "utf8"), "print('hi')\n");
    assert.equal(await readFile(join(out, "Dockerfile"), "utf8"), "FROM python\nCOPY src /srv\n");
  });

  test("a Dockerfile outside the context is added under a name of its own", async () => {
    const ctx = join(dir, "ctx2");
    await mkdir(ctx);
    await writeFile(join(ctx, "a.txt"), "a");
    await writeFile(join(dir, "Other.Dockerfile"), "FROM python\n");
    const { tar, dockerfile } = await packContext(ctx, join(dir, "Other.Dockerfile"));
    assert.equal(dockerfile, ".agentbox.Dockerfile");
    const out = join(dir, "out2");
    await mkdir(out);
    assert.deepEqual(untar(tar, out).sort(), [".agentbox.Dockerfile", "a.txt"]);
    assert.equal((await packContext(ctx, join(ctx, "a.txt"))).dockerfile, "a.txt");
    await assert.rejects(packContext(join(dir, "nope")), InvalidArgumentError);
  });

  test("tar entries: sizes on block boundaries, modes, in-memory files", async () => {
    const out = join(dir, "out3");
    await mkdir(out);
    const tar = tarArchive([{ name: "x/512.bin", data: new Uint8Array(512).fill(1), mode: 0o755 },
                            { name: "empty", data: new Uint8Array(0) }]);
    assert.equal(tar.length % 512, 0);
    assert.deepEqual(untar(tar, out), ["x/512.bin", "empty"]);
    assert.equal((await readFile(join(out, "x/512.bin"))).length, 512);
    assert.match(execFileSync("tar", ["-tvf", "-"], { input: tar }).toString(), /^-rwxr-xr-x/);
    assert.deepEqual(untar(packFiles({ Dockerfile: "FROM python\n", "a/b": new Uint8Array([1, 2]) }), out),
      ["Dockerfile", "a/b"]);
  });

  test("ignore patterns match as Python's fnmatch (`*` crosses `/`)", () => {
    assert.ok(globRegExp("*.log").test("a/b.log"));
    assert.ok(globRegExp("data?.csv").test("data1.csv"));
    assert.ok(!globRegExp("data?.csv").test("data10.csv"));
    assert.ok(globRegExp("[!a]x").test("bx") && !globRegExp("[!a]x").test("ax"));
    assert.ok(globRegExp("a.b(c)").test("a.b(c)") && !globRegExp("a.b").test("axb"));
    assert.ok(skipped("build/out.o", ["build"]) && !skipped("builder", ["build"]));
    assert.ok(skipped("x/__pycache__/m.pyc", []));
  });
});

describe("Dockerfile builds", () => {
  test("build: the context goes as a tar, the log goes to onEvent, the finished build comes back", async () => {
    let sent: { name: string | null; dockerfile: string | null; type: string | undefined; tar: Buffer } | undefined;
    fake.route("POST /v1/templates/builds", (req, res) => {
      sent = { name: req.query.get("name"), dockerfile: req.query.get("dockerfile"),
               type: req.headers["content-type"], tar: req.body };
      json(res, 202, { build: BUILD });
    });
    fake.route("GET /v1/templates/builds/b1/log", (_req, res) => ndjson(res, [
      { type: "queued", t: 0 }, { type: "step", n: 1, of: 3, text: "FROM python", cached: false },
      { type: "output", n: 2, stream: "stdout", text: "hi\n" }, { type: "step_done", n: 2, seconds: 1.5 },
      { type: "done", state: "ready", template: "web" }]));
    fake.route("GET /v1/templates/builds/b1", (_req, res) => json(res, 200, { build: {
      ...BUILD, state: "ready", step: 3, finished_at: 9, template: { name: "web", owner: "tenant", source: "dockerfile" } } }));
    const events: BuildEvent[] = [];
    const done = await box.templates.build("web", { Dockerfile: "FROM python\nRUN echo hi\n", "m.txt": "x" },
      { onEvent: async (e) => { events.push(e); } });
    assert.equal(sent?.name, "web");
    assert.equal(sent?.dockerfile, "Dockerfile");
    assert.equal(sent?.type, "application/x-tar");
    const out = join(dir, "out4");
    await mkdir(out);
    assert.deepEqual(untar(sent!.tar, out), ["Dockerfile", "m.txt"]);
    assert.deepEqual(events.map((e) => e.type), ["queued", "step", "output", "step_done", "done"]);
    assert.equal(done.state, "ready");
    assert.equal(done.template?.source, "dockerfile");
    assert.equal(done.finishedAt, 9);
    const started = await box.builds.build("web", { Dockerfile: "FROM python\n" }, { wait: false });
    assert.equal(started.state, "queued");
    assert.equal(started.template, null);
  });

  test("a failed build throws TemplateBuildError carrying the build", async () => {
    fake.route("POST /v1/templates/builds", (_req, res) => json(res, 202, { build: { ...BUILD, id: "b2" } }));
    fake.route("GET /v1/templates/builds/b2/log", (_req, res) => ndjson(res, [
      { type: "error", message: "step 2 (RUN false) exited 1", exit_code: 1 }, { type: "done", state: "failed" }]));
    fake.route("GET /v1/templates/builds/b2", (_req, res) => json(res, 200, { build: {
      ...BUILD, id: "b2", state: "failed", error: "step 2 (RUN false) exited 1" } }));
    await assert.rejects(box.builds.build("web", { Dockerfile: "FROM python\nRUN false\n" }), (e: unknown) =>
      e instanceof TemplateBuildError && e.build.id === "b2" && e.code === "build_failed"
      && /exited 1/.test(e.message));
  });

  test("a log cut short while the build runs is a StreamInterruptedError", async () => {
    fake.route("GET /v1/templates/builds/b3/log", (_req, res) => ndjson(res, [{ type: "step", n: 1, of: 2 }]));
    fake.route("GET /v1/templates/builds/b3", (_req, res) => json(res, 200, { build: { ...BUILD, id: "b3", state: "running" } }));
    const seen: string[] = [];
    for await (const e of box.builds.logs("b3")) seen.push(String(e.type));
    assert.deepEqual(seen, ["step"]);
    await assert.rejects(box.builds.wait("b3"), StreamInterruptedError);
  });
});
