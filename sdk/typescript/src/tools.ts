/**
 * Sandbox tools for agent frameworks: the same five as the Python SDK (`run_code`,
 * `run_command`, `read_file`, `write_file`, `list_files`) as plain JSON-schema definitions,
 * their shapes for OpenAI function calling (chat completions and Responses) and Anthropic tool
 * use, Vercel AI SDK tools built from the caller's own `ai` module, and a dispatcher that runs
 * a model's tool calls in a sandbox.
 *
 * An API error does not throw: the model gets it as an error result, so it can correct itself
 * (a wrong path, a timeout). Long output is cut to `maxChars` (20,000).
 */

import { AgentBoxError, EndpointNotFoundError } from "./errors.js";
import type { Execution, ExecResult, FileInfo } from "./models.js";
import type { Sandbox } from "./sandbox.js";

export type JSONSchema = Record<string, unknown>;

export interface ToolSpec {
  name: ToolName;
  description: string;
  parameters: JSONSchema;
}

export type ToolName = "run_code" | "run_command" | "read_file" | "write_file" | "list_files";

const str = (description: string): JSONSchema => ({ type: "string", description });

export const TOOL_SPECS: readonly ToolSpec[] = Object.freeze([
  {
    name: "run_code",
    description: "Run Python code in a stateful interpreter inside an isolated sandbox (a microVM). "
      + "Variables, imports and files persist between calls, as in a Jupyter notebook. Returns "
      + "stdout, stderr, the value of the last expression, and the error with its traceback if "
      + "the code raised. Charts (matplotlib) come back as images.",
    parameters: { type: "object", properties: { code: str("The Python code to run.") },
                  required: ["code"], additionalProperties: false },
  },
  {
    name: "run_command",
    description: "Run a shell command (bash) in the sandbox and wait for it. Returns its exit code, "
      + "stdout and stderr. Use it to install packages, run programs, inspect files.",
    parameters: {
      type: "object",
      properties: {
        command: str("The command line to run."),
        cwd: str("Working directory (default /root)."),
        timeout: { type: "number", description: "Seconds before it is killed (default 60)." },
      },
      required: ["command"], additionalProperties: false,
    },
  },
  {
    name: "read_file",
    description: "Read a text file from the sandbox (relative paths are under /root).",
    parameters: { type: "object", properties: { path: str("The file to read.") },
                  required: ["path"], additionalProperties: false },
  },
  {
    name: "write_file",
    description: "Write a text file in the sandbox, creating parent directories and replacing the "
      + "file if it exists (relative paths are under /root).",
    parameters: {
      type: "object",
      properties: { path: str("The file to write."), content: str("The whole new content.") },
      required: ["path", "content"], additionalProperties: false,
    },
  },
  {
    name: "list_files",
    description: "List a directory in the sandbox: name, type and size of each entry.",
    parameters: { type: "object", properties: { path: str("The directory (default /root).") },
                  additionalProperties: false },
  },
] satisfies ToolSpec[]);

export const TOOL_NAMES: readonly ToolName[] = TOOL_SPECS.map((s) => s.name);

function specs(names?: readonly string[]): ToolSpec[] {
  const unknown = (names ?? []).filter((n) => !TOOL_NAMES.includes(n as ToolName));
  if (unknown.length) {
    throw new Error(`unknown tool(s): ${unknown.join(", ")}; available: ${TOOL_NAMES.join(", ")}`);
  }
  return TOOL_SPECS.filter((s) => !names || names.includes(s.name))
    .map((s) => structuredClone(s) as ToolSpec);
}

/** `tools:` for OpenAI chat completions (function calling). */
export function openaiTools(names?: readonly string[]): Array<{
  type: "function"; function: { name: string; description: string; parameters: JSONSchema };
}> {
  return specs(names).map((s) => ({ type: "function", function: { name: s.name, description: s.description, parameters: s.parameters } }));
}

/** `tools:` for the OpenAI Responses API (flat function definitions). */
export function openaiResponsesTools(names?: readonly string[]): Array<{
  type: "function"; name: string; description: string; parameters: JSONSchema;
}> {
  return specs(names).map((s) => ({ type: "function", name: s.name, description: s.description, parameters: s.parameters }));
}

/** `tools:` for Anthropic's Messages API. */
export function anthropicTools(names?: readonly string[]): Array<{
  name: string; description: string; input_schema: JSONSchema;
}> {
  return specs(names).map((s) => ({ name: s.name, description: s.description, input_schema: s.parameters }));
}

// -- results --------------------------------------------------------------------------------

export const MAX_CHARS = 20_000;

/** What a tool call produced: text for the model, images (charts), and whether it failed. */
export interface ToolOutput {
  text: string;
  images: Array<{ mimeType: string; data: string }>;
  isError: boolean;
}

export class ToolArgumentError extends Error {
  override name = "ToolArgumentError";
}

export function cut(text: string, limit = MAX_CHARS): string {
  return text.length <= limit ? text : `${text.slice(0, limit)}\n... [${text.length - limit} more characters cut]`;
}

function sections(pairs: Array<[string, string | null | undefined]>, limit: number): string {
  const parts = pairs.filter(([, v]) => v).map(([name, v]) => `${name}:\n${cut(v!, limit)}`);
  return parts.length ? parts.join("\n") : "(no output)";
}

export function formatExecution(ex: Execution, limit = MAX_CHARS): ToolOutput {
  const images: ToolOutput["images"] = [];
  const texts: string[] = [];
  for (const result of ex.results) {
    const mime = ["image/png", "image/jpeg"].find((m) => result.data[m]);
    if (mime) {
      images.push({ mimeType: mime, data: String(result.data[mime]) });
      texts.push(`[${mime} image attached]`);
    } else if (result.text !== undefined) {
      texts.push(result.text);
    }
  }
  const error = ex.error ? ex.error.traceback || ex.error.toString() : undefined;
  const text = sections([["stdout", ex.stdout], ["stderr", ex.stderr], ["result", texts.join("\n")],
                         ["error", error]], limit);
  return { text, images, isError: ex.error !== null };
}

export function formatExec(res: ExecResult, limit = MAX_CHARS): ToolOutput {
  const note = res.timedOut ? " (timed out and killed)" : "";
  const text = `exit_code: ${res.exitCode}${note}\n`
    + sections([["stdout", res.stdout], ["stderr", res.stderr]], limit);
  return { text, images: [], isError: !res.ok };
}

export function formatListing(path: string, entries: FileInfo[]): ToolOutput {
  const lines = entries.map((e) => `${e.type.padEnd(7)} ${String(e.size).padStart(10)}  ${e.name}${e.isDir ? "/" : ""}`);
  return { text: `${path}:\n${lines.length ? lines.join("\n") : "(empty)"}`, images: [], isError: false };
}

export function parseArguments(name: string, args: unknown): Record<string, unknown> {
  if (!TOOL_NAMES.includes(name as ToolName)) {
    throw new ToolArgumentError(`unknown tool '${name}'; available: ${TOOL_NAMES.join(", ")}`);
  }
  let value = args ?? {};
  if (typeof value === "string") {
    try {
      value = value.trim() ? JSON.parse(value) : {};
    } catch (exc) {
      throw new ToolArgumentError(`arguments are not valid JSON: ${(exc as Error).message}`);
    }
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new ToolArgumentError("arguments must be a JSON object");
  }
  return value as Record<string, unknown>;
}

function need(args: Record<string, unknown>, key: string): string {
  const value = args[key];
  if (typeof value !== "string") throw new ToolArgumentError(`'${key}' (a string) is required`);
  return value;
}

const optional = <T>(value: unknown, type: string): T | undefined =>
  (typeof value === type ? (value as T) : undefined);

// -- the dispatcher ---------------------------------------------------------------------------

/** An OpenAI chat-completions tool call (the SDK's object or its JSON). */
export interface OpenAIToolCall {
  id: string;
  function: { name: string; arguments: string | Record<string, unknown> };
}

/** An Anthropic `tool_use` content block. */
export interface AnthropicToolUse {
  id: string;
  name: string;
  input: unknown;
}

/** Runs tool calls in a {@link Sandbox}. */
export class ToolDispatcher {
  constructor(readonly sandbox: Sandbox, readonly maxChars = MAX_CHARS) {}

  /** Run one call by name and arguments (an object or a JSON string). Never throws for API errors. */
  async call(name: string, args?: unknown): Promise<ToolOutput> {
    try {
      return await this.run(name, parseArguments(name, args));
    } catch (exc) {
      if (exc instanceof AgentBoxError || exc instanceof ToolArgumentError) {
        return { text: `error: ${exc.message}${exc instanceof AgentBoxError && exc.status ? ` [${exc.code}]` : ""}`,
                 images: [], isError: true };
      }
      throw exc;
    }
  }

  private async run(name: string, args: Record<string, unknown>): Promise<ToolOutput> {
    const sb = this.sandbox;
    const limit = this.maxChars;
    switch (name) {
      case "run_code": {
        const code = need(args, "code");
        try {
          return formatExecution(await sb.runCode(code), limit);
        } catch (exc) {
          if (exc instanceof EndpointNotFoundError) return formatExec(await sb.execute(code), limit);
          throw exc;
        }
      }
      case "run_command":
        return formatExec(await sb.execute({
          command: need(args, "command"), cwd: optional<string>(args.cwd, "string"),
          timeout: optional<number>(args.timeout, "number"),
        }), limit);
      case "read_file": {
        const data = await sb.files.read(need(args, "path"), { format: "bytes" });
        return { text: cut(new TextDecoder().decode(data), limit), images: [], isError: false };
      }
      case "write_file": {
        const info = await sb.files.write(need(args, "path"), need(args, "content"));
        return { text: `wrote ${info.size} bytes to ${info.path}`, images: [], isError: false };
      }
      default: {
        const path = optional<string>(args.path, "string") || "/root";
        return formatListing(path, await sb.files.list(path));
      }
    }
  }

  /** The `role: "tool"` message answering an OpenAI tool call (chat completions carry text only). */
  async openai(toolCall: OpenAIToolCall): Promise<{ role: "tool"; tool_call_id: string; content: string }> {
    const out = await this.call(toolCall.function.name, toolCall.function.arguments);
    return { role: "tool", tool_call_id: toolCall.id, content: out.text };
  }

  /** The `function_call_output` item answering a Responses API `function_call` item. */
  async openaiResponses(item: { call_id: string; name: string; arguments: string }):
    Promise<{ type: "function_call_output"; call_id: string; output: string }> {
    const out = await this.call(item.name, item.arguments);
    return { type: "function_call_output", call_id: item.call_id, output: out.text };
  }

  /** The `tool_result` block answering an Anthropic `tool_use` block (images included). */
  async anthropic(toolUse: AnthropicToolUse): Promise<Record<string, unknown>> {
    const out = await this.call(toolUse.name, toolUse.input);
    const content: Array<Record<string, unknown>> = [{ type: "text", text: out.text }];
    for (const image of out.images) {
      content.push({ type: "image", source: { type: "base64", media_type: image.mimeType, data: image.data } });
    }
    return { type: "tool_result", tool_use_id: toolUse.id, content, is_error: out.isError };
  }
}

// -- Vercel AI SDK ----------------------------------------------------------------------------

/** The parts of the `ai` package used here: `import * as ai from "ai"` fits. */
export interface AIModule {
  jsonSchema: (schema: never) => unknown;
  tool?: (definition: never) => unknown;
}

/**
 * Vercel AI SDK tools (`generateText({ tools })`), built with the caller's own `ai` module so
 * this package does not depend on it: `vercelTools(sandbox, ai)`. Each tool's `execute` runs
 * in the sandbox and returns the text the model sees (errors included, as text).
 */
export function vercelTools(sandbox: Sandbox, ai: AIModule,
                            options: { names?: readonly string[]; maxChars?: number } = {}):
  Record<string, unknown> {
  const dispatch = new ToolDispatcher(sandbox, options.maxChars);
  const tools: Record<string, unknown> = {};
  for (const spec of specs(options.names)) {
    const schema = ai.jsonSchema(spec.parameters as never);
    const definition = {
      description: spec.description,
      inputSchema: schema, // ai 5+
      parameters: schema, // ai 4
      execute: async (input: unknown) => (await dispatch.call(spec.name, input)).text,
    };
    tools[spec.name] = ai.tool ? ai.tool(definition as never) : definition;
  }
  return tools;
}
