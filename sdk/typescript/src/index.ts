/**
 * AgentBox: the TypeScript SDK for self-hosted microVM sandboxes.
 *
 * ```ts
 * import { AgentBox } from "@agentbox/sdk";
 * const box = new AgentBox();                    // AGENTBOX_API_KEY / AGENTBOX_URL
 * const sandbox = await box.create({ environment: "python" });
 * const result = await sandbox.execute("print(1)");
 * console.log(result.stdout);
 * ```
 */

export { AgentBox, DEFAULT_TEMPLATE, type CreateOptions, type ListOptions } from "./client.js";
export { Sandbox, type ExecOptions, type RunCodeOptions } from "./sandbox.js";
export {
  CommandHandle, Commands, MAX_REATTACH, reattachDelay, type CommandOptions, type OutputCallback,
  type OutputCallbacks,
} from "./commands.js";
export { Files, type Progress, type TransferOptions, type WriteData } from "./files.js";
export { Session, Sessions } from "./sessions.js";
export { Terminal, type TerminalOptions } from "./terminal.js";
export type { Egress, ListFilters, SessionSpec } from "./calls.js";
export { Builds, type BuildContext, type BuildOptions, type Templates } from "./templates.js";
export {
  ALWAYS_SKIPPED, MAX_CONTEXT_BYTES, packContext, packFiles, tarArchive, type TarEntry,
} from "./context.js";
export {
  CommandResult, ExecResult, Execution, ExecutionError, Result, type OutputFile,
  type CodeContext, type FileInfo, type OutputChunk, type PreviewAccess, type ProcessInfo,
  type SandboxInfo, type SandboxState, type ServerInfo, type SessionView, type StartState,
  type Template, type SandboxPage, type Usage, type KeyUsage, type SandboxUsage, type UsageFigures,
  type SandboxMetrics, type SandboxLogs, type SandboxEvent, type EgressPolicy, type TemplateBuild,
  type BuildEvent,
} from "./models.js";
/** The API's JSON answers parsed into the models above (what the client does with them). */
export {
  parseBuild, parseContext, parseEgress, parseFileInfo, parseLogs, parseMetrics, parsePreview, parseProcess, parseSandbox,
  parseSandboxPage, parseServerInfo, parseSessionView, parseTemplate, parseUsage,
} from "./models.js";
export { ExecutionBuilder, CommandOutput, type RunNotice } from "./streams.js";
export { DEFAULT_TIMEOUT, DEFAULT_URL, type ClientOptions, type Event } from "./transport.js";
export * from "./errors.js";
export {
  MAX_CHARS, TOOL_NAMES, TOOL_SPECS, ToolArgumentError, ToolDispatcher, anthropicTools,
  openaiResponsesTools, openaiTools, vercelTools,
  type AIModule, type AnthropicToolUse, type OpenAIToolCall, type ToolName, type ToolOutput,
  type ToolSpec,
} from "./tools.js";

export const VERSION = "0.1.0";
