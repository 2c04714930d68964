// Every call the page makes: the normal API, with the tab's key when it has one.

const KEY_SLOT = "splitserve.apiKey";

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export const auth = {
  get key() {
    return sessionStorage.getItem(KEY_SLOT) || "";
  },
  set key(value) {
    if (value) sessionStorage.setItem(KEY_SLOT, value);
    else sessionStorage.removeItem(KEY_SLOT);
  },
  // Set by main.js: shows the key form with the API's message on a 401.
  onUnauthorized: (message) => {},
};

function headers(extra = {}) {
  const h = { ...extra };
  if (auth.key) h.Authorization = `Bearer ${auth.key}`;
  return h;
}

async function failure(resp) {
  let body = null;
  let message = `${resp.status} ${resp.statusText}`;
  try {
    body = await resp.json();
    if (body && body.error && body.error.message) message = `${resp.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: keep the status line
  }
  if (resp.status === 401) auth.onUnauthorized(message);
  return new ApiError(resp.status, message, body);
}

export async function getJSON(path) {
  const resp = await fetch(path, { headers: headers() });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

// POST /v1/chat/completions with stream: true. Calls onChunk(parsed, arrivalMs) for every SSE
// data event; resolves when the stream ends, rejects with an AbortError when `signal` aborts
// (the server sees the connection close and cancels the request on the workers).
export async function streamChat(body, signal, onChunk) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    const now = performance.now();
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(500, `stream error: ${parsed.error.message}`, parsed);
        onChunk(parsed, now);
      }
    }
  }
}
