/**
 * Every error the SDK throws, in families by cause.
 *
 * The server answers errors as `{"error": {"code", "message"}}` with a meaningful status.
 * {@link errorFromResponse} turns such an answer into the most specific class here: first by
 * `code` (stable, machine-readable; the table is docs/api.md's), then by status family.
 * Failures below HTTP (connection refused, a broken stream, our own timeout) are mapped at the
 * transport edge into {@link APIConnectionError} / {@link TimeoutError}, with the original
 * error as `cause`, so callers never need to inspect `fetch`'s own errors.
 */

export interface ErrorOptions {
  status?: number;
  code?: string;
  retryAfter?: number | undefined;
  cause?: unknown;
}

/** Base class of every AgentBox SDK error. `status` is 0 when no response was received. */
export class AgentBoxError extends Error {
  static defaultStatus = 0;
  static defaultCode = "error";
  /** HTTP status (0: no answer from the server). */
  readonly status: number;
  /** The server's stable error code (match on this, not on the message). */
  readonly code: string;
  /** The server's `Retry-After` hint, in seconds. */
  readonly retryAfter: number | undefined;

  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    const cls = new.target as unknown as typeof AgentBoxError;
    this.name = new.target.name;
    this.status = options.status ?? cls.defaultStatus;
    this.code = options.code ?? cls.defaultCode;
    this.retryAfter = options.retryAfter;
  }

  override toString(): string {
    return this.status ? `${this.name}: ${this.message} [${this.code}]` : `${this.name}: ${this.message}`;
  }
}

// -- client side ---------------------------------------------------------------------------

/** The SDK is missing something it needs locally (e.g. no API key). */
export class ConfigurationError extends AgentBoxError {
  static override defaultCode = "configuration";
}

/** The server could not be reached, or the connection broke. */
export class APIConnectionError extends AgentBoxError {
  static override defaultCode = "connection_error";
}

/** A streamed response ended before its final line (the connection broke). */
export class StreamInterruptedError extends APIConnectionError {
  static override defaultCode = "stream_interrupted";
}

/** The server answered something this SDK does not understand. */
export class ProtocolError extends AgentBoxError {
  static override defaultCode = "protocol_error";
}

/**
 * A template build from a Dockerfile ended `failed` (the server answered fine: the build
 * did not). `build` is the {@link TemplateBuild}; its `error` names the step and exit code.
 */
export class TemplateBuildError extends AgentBoxError {
  static override defaultCode = "build_failed";
  constructor(readonly build: { id: string; name: string; error: string | null }, options: ErrorOptions = {}) {
    super(`template build ${build.id} (${build.name}) failed: ${build.error ?? "no reason given"}`, options);
  }
}

// -- answered by the server ----------------------------------------------------------------

/** 400: the request was malformed or a value was out of range. */
export class InvalidArgumentError extends AgentBoxError {
  static override defaultStatus = 400;
  static override defaultCode = "bad_request";
}

/** 401: the API key is missing or invalid. */
export class AuthenticationError extends AgentBoxError {
  static override defaultStatus = 401;
  static override defaultCode = "invalid_api_key";
}

/** 403: the API key may not do this (e.g. minting keys needs an admin key). */
export class PermissionDeniedError extends AgentBoxError {
  static override defaultStatus = 403;
  static override defaultCode = "forbidden";
}

/** 404: the object does not exist (or belongs to another tenant). */
export class NotFoundError extends AgentBoxError {
  static override defaultStatus = 404;
  static override defaultCode = "not_found";
}

export class SandboxNotFoundError extends NotFoundError {
  static override defaultCode = "sandbox_not_found";
}

export class TemplateNotFoundError extends NotFoundError {
  static override defaultCode = "template_not_found";
}

export class ContextNotFoundError extends NotFoundError {
  static override defaultCode = "context_not_found";
}

export class ProcessNotFoundError extends NotFoundError {
  static override defaultCode = "process_not_found";
}

export class SessionNotFoundError extends NotFoundError {
  static override defaultCode = "session_not_found";
}

/** 404/405 for the route itself: this server does not offer the endpoint. */
export class EndpointNotFoundError extends NotFoundError {
  static override defaultCode = "no_route";
}

/** 409: the object is in the wrong state for this (e.g. sandbox not running). */
export class ConflictError extends AgentBoxError {
  static override defaultStatus = 409;
  static override defaultCode = "conflict";
}

/** 409 `quota_exceeded`: the API key is at one of its limits. */
export class QuotaExceededError extends ConflictError {
  static override defaultCode = "quota_exceeded";
}

/** 413: an upload or request body is over the server's limit. */
export class PayloadTooLargeError extends AgentBoxError {
  static override defaultStatus = 413;
  static override defaultCode = "payload_too_large";
}

/** 429: too many requests (`rate_limited`: retry after `retryAfter` s), contexts or processes. */
export class RateLimitError extends AgentBoxError {
  static override defaultStatus = 429;
  static override defaultCode = "rate_limited";
}

/** 500: the server failed unexpectedly (the message carries a request id). */
export class ServerError extends AgentBoxError {
  static override defaultStatus = 500;
  static override defaultCode = "internal";
}

/** 502: the sandbox's VM or guest agent failed (crashed, unreachable, bad snapshot). */
export class SandboxError extends AgentBoxError {
  static override defaultStatus = 502;
  static override defaultCode = "vm_gone";
}

/** 503: the host is at capacity or busy; retry after `retryAfter` seconds. */
export class UnavailableError extends AgentBoxError {
  static override defaultStatus = 503;
  static override defaultCode = "unavailable";
}

/** 504 from the server, or the SDK's own timeout expired. */
export class TimeoutError extends AgentBoxError {
  static override defaultStatus = 504;
  static override defaultCode = "timeout";
}

/** 507: the sandbox's disk is full. */
export class StorageFullError extends SandboxError {
  static override defaultStatus = 507;
  static override defaultCode = "no_space";
}

type ErrorClass = new (message: string, options?: ErrorOptions) => AgentBoxError;

function codes(cls: ErrorClass, names: string): Array<[string, ErrorClass]> {
  return names.split(/\s+/).filter(Boolean).map((name) => [name, cls]);
}

/** Every error code the server documents (docs/api.md, "Error codes"), to its class. */
export const ERROR_CODES: ReadonlyMap<string, ErrorClass> = new Map<string, ErrorClass>([
  ...codes(InvalidArgumentError, `bad_request bad_json invalid_type invalid_path invalid_cwd invalid_egress
    not_a_directory is_a_directory bad_session_name websocket_required http_error
    invalid_resources bad_template_name bad_dockerfile bad_context`),
  ...codes(AuthenticationError, "missing_api_key invalid_api_key unauthorized"),
  ...codes(PermissionDeniedError, "forbidden port_reserved cross_origin_refused resource_limit"),
  ...codes(SandboxNotFoundError, "sandbox_not_found"),
  ...codes(TemplateNotFoundError, "template_not_found"),
  ...codes(ContextNotFoundError, "context_not_found"),
  ...codes(ProcessNotFoundError, "process_not_found"),
  ...codes(SessionNotFoundError, "session_not_found"),
  ...codes(NotFoundError, `session_not_ready key_not_found not_found port_not_listening
    build_not_found`),
  ...codes(EndpointNotFoundError, "no_route method_not_allowed"),
  ...codes(ConflictError, `conflict not_running suspend_cancelled stdin_closed context_exists
    session_name_taken template_exists template_builtin build_running`),
  ...codes(QuotaExceededError, "quota_exceeded"),
  ...codes(PayloadTooLargeError, "payload_too_large too_large"),
  ...codes(RateLimitError, "rate_limited too_many_contexts too_many_processes too_many_requests"),
  ...codes(ServerError, `internal network_error image_error disk_error context_start_failed
    forward_failed`),
  ...codes(SandboxError, `restore_failed vm_start_failed vm_gone vmm_protocol_error
    snapshot_invalid agent_unreachable agent_error agent_protocol_error agent_reply_too_large
    port_closed bad_gateway vm_error sandbox_lost`),
  ...codes(UnavailableError, `unavailable sandbox_limit hold_queue_full sandbox_crashed
    template_building template_build_failed builds_unavailable host_fenced owner_unavailable
    forward_loop`),
  ...codes(TimeoutError, "vm_timeout wake_timeout upstream_timeout agent_timeout"),
  ...codes(StorageFullError, "no_space"),
  // 499: logged when the client has gone; no client reads it, but it is a server code.
  ...codes(AgentBoxError as ErrorClass, "client_closed"),
]);

const BY_STATUS: ReadonlyMap<number, ErrorClass> = new Map<number, ErrorClass>([
  [400, InvalidArgumentError], [401, AuthenticationError], [403, PermissionDeniedError],
  [404, NotFoundError], [405, EndpointNotFoundError], [409, ConflictError],
  [410, SandboxError], [413, PayloadTooLargeError], [429, RateLimitError], [500, ServerError], [502, SandboxError],
  [503, UnavailableError], [504, TimeoutError], [507, StorageFullError],
  [508, UnavailableError],
]);

/** The class for an error answer: by code, then by status family. */
export function errorClass(status: number, code: string): ErrorClass {
  const byCode = ERROR_CODES.get(code);
  if (byCode) return byCode;
  const byStatus = BY_STATUS.get(status);
  if (byStatus) return byStatus;
  if (status >= 400 && status < 500) return InvalidArgumentError;
  return status < 502 ? ServerError : SandboxError;
}

function retryAfterOf(value: string | null | undefined): number | undefined {
  if (value === null || value === undefined || value.trim() === "") return undefined;
  const seconds = Number(value);
  return Number.isFinite(seconds) ? seconds : undefined;
}

/**
 * The error for an HTTP error answer. `body` is its text; when it is our JSON error shape the
 * code and message come from it, else from the status.
 */
export function errorFromResponse(status: number, body: string,
                                  retryAfter?: string | null): AgentBoxError {
  let code: string | undefined;
  let message = `HTTP ${status}`;
  try {
    const parsed: unknown = JSON.parse(body);
    const err = (parsed as { error?: { code?: unknown; message?: unknown } } | null)?.error;
    if (err && typeof err.code === "string") {
      code = err.code;
      message = String(err.message ?? "");
    }
  } catch {
    if (body.trim()) message = `HTTP ${status}: ${body.trim().slice(0, 300)}`;
  }
  const cls = errorClass(status, code ?? "");
  const fallback = (cls as unknown as typeof AgentBoxError).defaultCode;
  return new cls(message, { status, code: code ?? fallback, retryAfter: retryAfterOf(retryAfter) });
}
