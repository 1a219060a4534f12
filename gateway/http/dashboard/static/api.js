// The REST API, called with the key in the Authorization header (never a URL, never a
// cookie). The key lives in sessionStorage: gone when the tab closes.
const STORE = "agentbox.key";

export const session = {
  get key() { return sessionStorage.getItem(STORE); },
  set(key) { sessionStorage.setItem(STORE, key); },
  clear() { sessionStorage.removeItem(STORE); },
  admin: false,  // from GET /v1/info at sign-in, as is keyId
  keyId: null,
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function authHeaders(extra = {}) {
  return { Authorization: `Bearer ${session.key}`, ...extra };
}

async function failure(resp) {
  let code = "http_error", message = `${resp.status} ${resp.statusText}`;
  try {
    const err = (await resp.json()).error;
    code = err.code;
    message = err.message;
  } catch { /* not our JSON error */ }
  if (resp.status === 401) window.dispatchEvent(new Event("agentbox:unauthorized"));
  return new ApiError(resp.status, code, message);
}

// fetch a /v1 path: JSON in (json:) or raw (body:), JSON or text out; raw: the Response.
export async function api(method, path, { json, body, headers = {}, raw = false, signal } = {}) {
  const h = authHeaders(headers);
  if (json !== undefined) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const resp = await fetch(path, { method, headers: h, body, signal, cache: "no-store",
                                   credentials: "omit", referrerPolicy: "no-referrer" });
  if (!resp.ok) throw await failure(resp);
  if (raw) return resp;
  if (resp.status === 204) return null;
  const type = resp.headers.get("Content-Type") || "";
  return type.startsWith("application/json") ? resp.json() : resp.text();
}

// The lines of a streamed response body (NDJSON, SSE), as they arrive.
export async function* lines(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value;
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      yield buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
    }
  }
  if (buf) yield buf;
}

// Server-sent events over fetch (EventSource cannot send the Authorization header):
// yields {event, data, id} records.
export async function* sse(path, signal) {
  const resp = await api("GET", path, { raw: true, signal,
                                        headers: { Accept: "text/event-stream" } });
  let rec = { event: "message", data: "", id: null };
  for await (const line of lines(resp)) {
    if (line === "") {
      if (rec.data !== "") yield rec;
      rec = { event: "message", data: "", id: null };
      continue;
    }
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "data") rec.data += (rec.data ? "\n" : "") + value;
    else if (field === "event") rec.event = value;
    else if (field === "id") rec.id = value;
  }
}
