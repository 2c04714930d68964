// The figures under a reply: speed measured here (arrival times), usage, cost, tier,
// replicas, routing and attempts from the response's own `usage` and `metadata`.

import { svg } from "./svg.js";

// `metadata` is string -> string as OpenAI types it; structured values travel as JSON.
export function parseMetadata(raw) {
  const out = {};
  for (const [key, value] of Object.entries(raw || {})) {
    try {
      out[key] = typeof value === "string" && /^[[{]/.test(value) ? JSON.parse(value) : value;
    } catch (_) {
      out[key] = value;
    }
  }
  return out;
}

export function percentile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil(q * sorted.length) - 1)];
}

export function timings(run) {
  const a = run.arrivals;
  const gaps = a.slice(1).map((t, i) => t - a[i]);
  const decodeS = a.length > 1 ? (a[a.length - 1] - a[0]) / 1000 : null;
  return {
    ttftMs: a.length ? a[0] - run.sent : null,
    itlMeanMs: gaps.length ? gaps.reduce((s, g) => s + g, 0) / gaps.length : null,
    itlP99Ms: percentile(gaps, 0.99),
    e2eMs: run.ended - run.sent,
    gaps,
    decodeS,
  };
}

const ms = (v) => (v == null ? "–" : `${v.toFixed(1)} ms`);

function figure(list, name, label, value, title) {
  const pair = document.createElement("div");
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  dd.dataset.figure = name;
  dd.textContent = value;
  if (title) dd.title = title;
  pair.append(dt, dd);
  list.append(pair);
  return dd;
}

export function renderFigures(run, { stopped = false, onTrace = null } = {}) {
  const last = run.final || run.first;
  const meta = parseMetadata(last.metadata);
  const usage = (run.final && run.final.usage) || null;
  const t = timings(run);
  const box = document.createElement("div");
  box.className = "figures";
  const dl = document.createElement("dl");
  figure(dl, "ttft", "TTFT", ms(t.ttftMs));
  figure(dl, "itl", "ITL mean / p99", `${ms(t.itlMeanMs)} / ${ms(t.itlP99Ms)}`);
  const completion = usage ? usage.completion_tokens : run.arrivals.length;
  const rate = t.decodeS ? (completion - 1) / t.decodeS : null;
  figure(dl, "tok-s", "tokens/s", rate == null ? "–" : rate.toFixed(1), "after the first token");
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    const share = usage.prompt_tokens ? (100 * cached) / usage.prompt_tokens : 0;
    figure(dl, "prompt-tokens", "prompt tokens", String(usage.prompt_tokens));
    figure(dl, "cached-tokens", "cached", `${cached} (${share.toFixed(0)}%)`);
    figure(dl, "completion-tokens", "completion tokens", String(usage.completion_tokens));
  } else {
    figure(dl, "completion-tokens", "completion tokens", `${completion} (stopped: no usage)`);
  }
  const cost = meta.cost && typeof meta.cost === "object" ? meta.cost.total_usd : null;
  figure(dl, "cost", "cost", cost == null ? "–" : `$${cost.toPrecision(3)}`);
  figure(dl, "tier", "tier", last.service_tier || meta.service_tier || "–");
  figure(dl, "model", "model", meta.model || last.model || "–");
  figure(dl, "replica", "replicas", meta.replica || "–");
  figure(dl, "e2e", "total", ms(t.e2eMs) + (stopped ? " (stopped)" : ""));
  box.append(dl);
  box.append(chart(t));
  box.append(routing(meta));
  const attempts = attemptList(meta.attempts);
  if (attempts) box.append(attempts);
  const actions = document.createElement("div");
  actions.className = "actions";
  if (meta.trace_id && onTrace) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "show-trace";
    b.textContent = "Waterfall";
    b.addEventListener("click", () => onTrace(meta.trace_id));
    actions.append(b);
  }
  const raw = document.createElement("details");
  raw.className = "raw";
  const summary = document.createElement("summary");
  summary.textContent = "raw";
  const pre = document.createElement("pre");
  pre.textContent = JSON.stringify({ usage, metadata: meta, service_tier: last.service_tier }, null, 2);
  raw.append(summary, pre);
  actions.append(raw);
  box.append(actions);
  return box;
}

function routing(meta) {
  const wrap = document.createElement("div");
  wrap.className = "routing";
  const head = document.createElement("strong");
  head.textContent = "Routing: ";
  wrap.append(head);
  // `reasoning` is the whole request's (every attempt, each line naming its model); a
  // response without it still has its pair's `routing`.
  const lines = [].concat(meta.reasoning || meta.routing || []);
  if (!lines.length) {
    wrap.append("no reasons given");
    return wrap;
  }
  const ul = document.createElement("ul");
  for (const line of lines) {
    const li = document.createElement("li");
    li.textContent = typeof line === "string" ? line : JSON.stringify(line);
    ul.append(li);
  }
  wrap.append(ul);
  return wrap;
}

function attemptList(attempts) {
  if (!Array.isArray(attempts) || !attempts.length) return null;
  const wrap = document.createElement("div");
  wrap.className = "attempts";
  const fallbacks = attempts.filter((a) => a.reason === "fallback").length;
  const migrations = attempts.filter((a) => a.reason === "migration").length;
  const head = document.createElement("strong");
  head.textContent = `Attempts: ${attempts.length} (fallbacks ${fallbacks}, migrations ${migrations})`;
  const ol = document.createElement("ol");
  for (const a of attempts) {
    const li = document.createElement("li");
    const ttft = a.ttft_ms == null ? "" : `, first token ${a.ttft_ms.toFixed(0)} ms`;
    const outcome = a.success ? "served" : `failed${a.error ? ": " + a.error : ""}`;
    li.textContent = `${a.reason}: ${a.model} on ${a.replica || "?"} after ${a.after_tokens} tokens${ttft} — ${outcome}`;
    ol.append(li);
  }
  wrap.append(head, ol);
  return wrap;
}

// Inter-token gaps as bars, one per token after the first: the reply's rhythm.
function chart(t) {
  const width = 320;
  const height = 48;
  const root = svg("svg", { class: "itl-chart", width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  const gaps = t.gaps;
  const label = `Inter-token gaps of ${gaps.length + 1} tokens; max ${ms(Math.max(0, ...gaps))}`;
  root.append(svg("title", {}, label));
  if (!gaps.length) return root;
  const top = Math.max(...gaps, 1);
  const w = width / gaps.length;
  gaps.forEach((g, i) => {
    const h = Math.max(1, (g / top) * (height - 2));
    root.append(svg("rect", { x: i * w, y: height - h, width: Math.max(1, w - 1), height: h }));
  });
  return root;
}
