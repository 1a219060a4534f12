/**
 * The SDK's models against the live server's own OpenAPI document (`GET /v1/openapi.json`):
 * for each schema the SDK parses, an answer carrying every property the spec lists (plus one
 * the spec does not know) parses, and every property lands in the model under its camelCase
 * name. A field added to the spec without the SDK fails here. Needs AGENTBOX_URL and
 * AGENTBOX_API_KEY (skips, saying so, without them).
 */

import assert from "node:assert/strict";
import { before, describe, test } from "node:test";

import {
  ERROR_CODES, ExecResult, Execution, parseBuild, parseContext, parseFileInfo, parseLogs, parseMetrics, parsePreview, parseProcess,
  parseSandbox, parseSandboxPage, parseServerInfo, parseSessionView, parseTemplate, parseUsage,
} from "@agentbox/sdk";

const URL_ = process.env.AGENTBOX_URL;
const KEY = process.env.AGENTBOX_API_KEY;
const skip = !URL_ || !KEY ? "AGENTBOX_URL and AGENTBOX_API_KEY are not set (no live daemon)" : false;

type Schema = Record<string, unknown>;
let schemas: Record<string, Schema> = {};

const PARSERS: Record<string, (data: unknown) => unknown> = {
  Sandbox: parseSandbox, Template: parseTemplate, Info: parseServerInfo, Preview: parsePreview,
  FileInfo: parseFileInfo, ProcessInfo: parseProcess, ContextInfo: parseContext,
  Session: parseSessionView, ExecResult: (d) => ExecResult.parse(d), Execution: (d) => Execution.parse(d),
  SandboxList: parseSandboxPage, Usage: parseUsage, SandboxMetrics: parseMetrics, SandboxLogs: parseLogs,
  Build: parseBuild,
};

/** A value of the schema's type (objects: every property filled in). */
function sample(schema: Schema, depth = 0): unknown {
  if (typeof schema.$ref === "string") return sample(schemas[schema.$ref.split("/").pop()!]!, depth + 1);
  if (Array.isArray(schema.anyOf)) return sample(schema.anyOf[0] as Schema, depth);
  if (Array.isArray(schema.enum)) return schema.enum[0];
  const type = Array.isArray(schema.type) ? schema.type.find((t) => t !== "null") : schema.type;
  switch (type) {
    case "string": return "s";
    case "integer": return 7;
    case "number": return 1.5;
    case "boolean": return true;
    case "array": return [];
    case "object": {
      const props = (schema.properties ?? {}) as Record<string, Schema>;
      return Object.fromEntries(Object.entries(props).map(([k, v]) => [k, depth > 3 ? null : sample(v, depth + 1)]));
    }
    default: return null;
  }
}

const camel = (name: string): string => name.replace(/_([a-z])/g, (_m, c: string) => c.toUpperCase());

describe("models against the live OpenAPI document", { skip }, () => {
  before(async () => {
    const resp = await fetch(`${URL_}/v1/openapi.json`, { headers: { Authorization: `Bearer ${KEY}` } });
    assert.equal(resp.status, 200);
    schemas = ((await resp.json()) as { components: { schemas: Record<string, Schema> } }).components.schemas;
  });

  test("ERROR_CODES maps exactly the codes of the spec's ErrorCode (the server's registry)", () => {
    const spec = new Set((schemas.ErrorCode?.enum ?? []) as string[]);
    assert.ok(spec.size >= 50, `the spec lists only ${spec.size} error codes`);
    assert.deepEqual([...spec].filter((c) => !ERROR_CODES.has(c)), [], "codes the SDK does not map");
    assert.deepEqual([...ERROR_CODES.keys()].filter((c) => !spec.has(c)), [], "codes the server does not have");
  });

  for (const [name, parse] of Object.entries(PARSERS)) {
    test(`${name}: every property parses, unknown fields are tolerated`, () => {
      const schema = schemas[name];
      assert.ok(schema, `the spec has no ${name} schema`);
      const answer = { ...(sample(schema) as Record<string, unknown>), zz_field_from_the_future: 1 };
      const model = parse(answer) as Record<string, unknown>;
      const missing = Object.keys((schema.properties ?? {}) as object)
        .filter((p) => !(camel(p) in model) && !(p in model) && !(p === "results" && "results" in model));
      assert.deepEqual(missing, [], `${name} fields the SDK does not parse`);
    });
  }
});
