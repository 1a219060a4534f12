/**
 * Templates, snapshots, forks, a Dockerfile build, egress, lifetimes, a disk shape, listing
 * filters and pages, metrics, logs and usage, against a live daemon with real microVMs (as
 * e2e.test.ts: AGENTBOX_URL / AGENTBOX_API_KEY, an admin key; skips, saying so, without them).
 * Four sandboxes and one builder VM in all; everything made here is deleted at the end.
 */

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  AgentBox, ConflictError, InvalidArgumentError, TemplateNotFoundError, type BuildEvent, type Sandbox,
} from "@agentbox/sdk";

const URL_ = process.env.AGENTBOX_URL;
const KEY = process.env.AGENTBOX_API_KEY;
const skip = !URL_ || !KEY ? "AGENTBOX_URL and AGENTBOX_API_KEY are not set (no live daemon)" : false;

const suffix = randomBytes(3).toString("hex");
const made: string[] = [];
const templates: string[] = [];
let box: AgentBox;
let a: Sandbox;
let bId = "";

async function track(sandbox: Sandbox): Promise<Sandbox> {
  made.push(sandbox.id);
  return sandbox;
}

describe("templates, builds and controls against a live daemon", { skip }, () => {
  before(() => {
    // Creates from a new template and snapshots copy memory: generous limits on a busy host.
    box = new AgentBox({ apiKey: KEY!, baseUrl: URL_!, timeout: 600 });
  });

  after(async () => {
    for (const id of made) await box.kill(id).catch(() => undefined);
    for (const name of templates) await box.templates.delete(name).catch(() => undefined);
  });

  test("create with egress, lifetimes, a disk and metadata; setEgress, setTtl; metrics, logs", async () => {
    const python = await box.templates.get("python");
    assert.equal(python.owner, "builtin");
    assert.ok(python.diskMib && python.diskMib > 0, `python's disk: ${python.diskMib}`);
    const diskMib = python.diskMib + 512;
    a = await track(await box.create({
      egress: "deny_all", ttl: 900, autoDeleteAfter: 600, diskMib, metadata: { suite: suffix, role: "a" } }));
    assert.deepEqual(a.info.egress, { default: "deny", allow: [], deny: [], source: "sandbox" });
    assert.equal(a.info.autoDeleteAfter, 600);
    assert.ok(Math.abs(a.info.expiresAt! - (a.info.createdAt! + 900)) < 5, `expiresAt ${a.info.expiresAt}`);
    assert.equal(a.info.diskMib, diskMib);
    const df = await a.execute({ command: "df -k --output=size / | tail -1" });
    const rootKib = Number(df.stdout.trim());
    assert.ok(rootKib > (diskMib - 200) * 1024 && rootKib <= diskMib * 1024, `/ is ${rootKib} KiB`);

    const rules = { default: "deny" as const, allow: ["pypi.org", "*.pythonhosted.org"], deny: [] };
    await a.setEgress(rules);
    assert.deepEqual((await a.getInfo()).egress, { ...rules, source: "sandbox" });
    await assert.rejects(a.setEgress({ allow: ["not a rule!"] }),
      (e: unknown) => e instanceof InvalidArgumentError && e.code === "invalid_egress");
    const before_ = Date.now() / 1000;
    const extended = await a.setTtl(1800);
    assert.ok(extended.expiresAt! >= before_ + 1790 && extended.expiresAt! <= Date.now() / 1000 + 1810,
      `expiresAt ${extended.expiresAt}`);

    await a.upload("in.txt", "input data");
    const streamed = await a.runCode(
      "import pathlib; pathlib.Path('/output/out.txt').write_text(pathlib.Path('/input/in.txt').read_text().upper())",
      { stream: true });
    assert.deepEqual(streamed.files, [{ path: "/output/out.txt", size: 10 }]);
    assert.equal(new TextDecoder().decode(await a.download("out.txt")), "INPUT DATA");

    const marker = `console-marker-${suffix}`;
    await a.execute({ command: `echo ${marker} > /dev/console` });
    const metrics = await a.metrics();
    assert.equal(metrics.sandboxId, a.id);
    assert.equal(metrics.state, "running");
    assert.ok(metrics.vmmPid && metrics.vmmPid > 0 && metrics.source !== null, JSON.stringify(metrics));
    assert.ok(metrics.diskBytes > 0 && (metrics.memoryBytes ?? metrics.rssBytes ?? 0) > 0);
    const logs = await a.logs(50);
    assert.equal(logs.sandboxId, a.id);
    assert.ok(logs.console.some((l) => l.includes(marker)), JSON.stringify(logs.console.slice(-5)));
    assert.ok(logs.console.length <= 50, `${logs.console.length} console lines`);
    assert.ok(logs.events.some((e) => e.to === "running"), JSON.stringify(logs.events));
  });

  test("snapshot to a template, create from it, fork: the state carries over; get, list, delete", async () => {
    await a.runCode("carried = 'from-a'");
    await a.files.write("/root/mark.txt", `mark-${suffix}`);
    const name = `ts-snap-${suffix}`;
    templates.push(name);
    const t = await a.snapshot(name);
    assert.equal(t.name, name);
    assert.equal(t.owner, "tenant");
    assert.equal(t.source, "snapshot");
    assert.equal(t.fromSandbox, a.id);
    assert.ok(typeof t.pausedMs === "number" && t.pausedMs >= 0, `pausedMs ${t.pausedMs}`);
    assert.equal((await box.templates.get(name)).source, "snapshot");
    assert.ok((await box.templates()).some((x) => x.name === name && x.owner === "tenant"));
    assert.equal((await a.execute({ command: "echo still-running" })).stdout, "still-running\n");

    const b = await track(await box.create({ template: name, metadata: { suite: suffix, role: "b" } }));
    bId = b.id;
    assert.equal(b.info.template, name);
    assert.equal((await b.runCode("carried")).text, "'from-a'");
    assert.equal(await b.files.read("/root/mark.txt"), `mark-${suffix}`);

    const [fork, ...more] = await a.fork(1);
    assert.equal(more.length, 0);
    await track(fork!);
    assert.notEqual(fork!.id, a.id);
    assert.equal((await fork!.runCode("carried")).text, "'from-a'");
    await fork!.runCode("carried = 'changed in the fork'");
    assert.equal((await a.runCode("carried")).text, "'from-a'");

    assert.equal(await box.templates.delete(name), true);
    assert.equal(await box.templates.delete(name), false);
    await assert.rejects(box.templates.get(name), TemplateNotFoundError);
    assert.equal((await b.execute({ command: "cat /root/mark.txt" })).stdout, `mark-${suffix}`);
    await assert.rejects(box.templates.delete("python"),
      (e: unknown) => e instanceof ConflictError && e.code === "template_builtin");
  });

  test("listing: metadata and state filters, pages by cursor, oldest first; usage", async () => {
    const mine = { suite: suffix };
    const all = await box.list({ metadata: mine });
    assert.ok(all.length >= 3, `${all.length} sandboxes of this suite`);
    assert.equal(all[0]!.id, a.id); // oldest first
    assert.deepEqual((await box.list({ metadata: { ...mine, role: "b" } })).map((s) => s.id), [bId]);
    assert.deepEqual((await box.list({ metadata: mine, state: ["running", "paused", "suspended"] })).map((s) => s.id),
      all.map((s) => s.id));
    assert.deepEqual(await box.list({ metadata: mine, state: "failed" }), []);
    const first = await box.listPage({ metadata: mine }, 1);
    assert.equal(first.sandboxes.length, 1);
    assert.ok(first.nextCursor, "a first page of 1 has a next cursor");
    const second = await box.listPage({ metadata: mine }, 1, first.nextCursor!);
    assert.equal(second.sandboxes[0]!.id, all[1]!.id);
    const paged: string[] = [];
    for await (const s of box.iterSandboxes({ metadata: mine }, 1)) paged.push(s.id);
    assert.deepEqual(paged, all.map((s) => s.id));
    assert.equal((await box.list({ metadata: mine, limit: 2 })).length, 2);
    await assert.rejects(box.listPage({ state: "sleepy" }),
      (e: unknown) => e instanceof InvalidArgumentError && e.code === "bad_request");

    const usage = await box.usage();
    const rows = usage.keys.flatMap((k) => k.sandboxes);
    const ofA = rows.find((r) => r.sandboxId === a.id);
    assert.ok(ofA, "sandbox a has a usage row");
    assert.ok(ofA.awakeSeconds > 0 && ofA.vcpuSeconds > 0 && ofA.created === 1, JSON.stringify(ofA));
    for (const id of made) await box.kill(id);
  });

  test("a Dockerfile build from a local directory: its log, the template, a sandbox made from it", async () => {
    const dir = await mkdtemp(join(tmpdir(), "agentbox-ts-build-"));
    const name = `ts-built-${suffix}`;
    templates.push(name);
    try {
      await writeFile(join(dir, "Dockerfile"), [
        "FROM python", "COPY . /srv/ctx/", "RUN cat /srv/ctx/msg.txt > /srv/built.txt && echo step-output",
        "ENV TS_GREETING=hello-ts", ""].join("\n"));
      await writeFile(join(dir, "msg.txt"), `msg-${suffix}\n`);
      await writeFile(join(dir, ".dockerignore"), "*.log\n");
      await writeFile(join(dir, "secret.log"), "must not be sent\n");
      const events: BuildEvent[] = [];
      const build = await box.templates.build(name, dir, { onEvent: (e) => { events.push(e); } });
      assert.equal(build.state, "ready", JSON.stringify(events.slice(-5)));
      assert.equal(build.name, name);
      assert.equal(build.error, null);
      assert.equal(build.template?.name, name);
      assert.equal(build.template?.source, "dockerfile");
      assert.ok(build.steps >= 3, `steps ${build.steps}`);
      assert.equal(events.at(-1)?.type, "done");
      assert.ok(events.filter((e) => e.type === "step").length >= 3, JSON.stringify(events.map((e) => e.type)));
      assert.ok(events.some((e) => e.type === "output" && String(e.text).includes("step-output")));
      assert.equal((await box.builds.get(build.id)).state, "ready");

      const sandbox = await track(await box.create({ template: name }));
      const out = await sandbox.execute({ command: "cat /srv/built.txt; echo $TS_GREETING; ls -A /srv/ctx" });
      assert.equal(out.stdout, `msg-${suffix}\nhello-ts\n.dockerignore\nDockerfile\nmsg.txt\n`);
      await sandbox.kill();
      assert.equal(await box.templates.delete(name), true);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
