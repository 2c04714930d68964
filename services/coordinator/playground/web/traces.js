// Trace waterfall: a request's spans across coordinator, prefill, transfer and decode,
// drawn from the coordinator's ring buffer of recent traces.

import { getJSON } from "./api.js";
import { svg } from "./svg.js";

const $ = (id) => document.getElementById(id);
const ROW = 20;
const LABEL = 260;
const WIDTH = 900;

function depthOf(spans) {
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const depth = new Map();
  const walk = (s) => {
    if (depth.has(s.span_id)) return depth.get(s.span_id);
    const parent = s.parent_span_id && byId.get(s.parent_span_id);
    const d = parent ? walk(parent) + 1 : 0;
    depth.set(s.span_id, d);
    return d;
  };
  spans.forEach(walk);
  return depth;
}

// Parents before children, siblings by start time: the order `splitserve trace` draws.
function ordered(spans) {
  const children = new Map();
  const ids = new Set(spans.map((s) => s.span_id));
  for (const s of spans) {
    const key = ids.has(s.parent_span_id) ? s.parent_span_id : null;
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(s);
  }
  const out = [];
  const visit = (key) => {
    for (const s of (children.get(key) || []).sort((a, b) => a.start_ns - b.start_ns)) {
      out.push(s);
      visit(s.span_id);
    }
  };
  visit(null);
  return out;
}

export function drawWaterfall(trace) {
  const spans = ordered(trace.spans);
  const depth = depthOf(spans);
  const start = Math.min(...spans.map((s) => s.start_ns));
  const end = Math.max(...spans.map((s) => s.end_ns));
  const total = Math.max(1, end - start);
  const scale = (WIDTH - LABEL - 70) / total;
  const height = ROW * (spans.length + 1);
  const root = svg("svg", { class: "waterfall-chart", width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`, role: "img" });
  root.append(svg("title", {}, `Trace ${trace.trace_id}: ${spans.length} spans over ${(total / 1e6).toFixed(1)} ms`));
  spans.forEach((s, i) => {
    const y = ROW * i + 4;
    const service = s.service.replace("splitserve-", "");
    const g = svg("g", { class: `span service-${service}${s.status === "ERROR" ? " error" : ""}` });
    const label = `${"  ".repeat(depth.get(s.span_id))}${service}: ${s.name}`;
    g.append(svg("text", { x: 4, y: y + 11 }, label));
    const x = LABEL + (s.start_ns - start) * scale;
    const w = Math.max(1, (s.end_ns - s.start_ns) * scale);
    const durMs = (s.end_ns - s.start_ns) / 1e6;
    const bar = svg("rect", { x, y, width: w, height: ROW - 8 });
    bar.append(svg("title", {}, `${s.name} (${s.kind}) ${durMs.toFixed(2)} ms`));
    g.append(bar);
    g.append(svg("text", { x: x + w + 4, y: y + 11, class: "duration" }, `${durMs.toFixed(1)} ms`));
    root.append(g);
  });
  return root;
}

export function setupTraces() {
  const list = $("trace-list");
  const errorEl = $("traces-error");

  function fail(exc) {
    errorEl.textContent = exc.message;
    errorEl.hidden = false;
  }

  async function open(traceId) {
    try {
      const trace = await getJSON(`/playground/api/traces/${encodeURIComponent(traceId)}`);
      const head = document.createElement("h2");
      head.textContent = `Trace ${trace.trace_id}`;
      $("waterfall").replaceChildren(head, drawWaterfall(trace));
      errorEl.hidden = true;
    } catch (exc) {
      fail(exc);
    }
  }

  async function refresh() {
    try {
      const traces = await getJSON("/playground/api/traces");
      list.replaceChildren(
        ...traces.data.map((t) => {
          const li = document.createElement("li");
          const b = document.createElement("button");
          b.type = "button";
          b.textContent = `${t.name} — ${t.duration_ms.toFixed(1)} ms, ${t.num_spans} spans (${t.services.join(", ")})`;
          b.addEventListener("click", () => open(t.trace_id));
          li.append(b);
          return li;
        }),
      );
      $("traces-summary").textContent = `${traces.data.length} recent traces`;
      errorEl.hidden = true;
    } catch (exc) {
      fail(exc);
    }
  }

  $("traces-refresh").addEventListener("click", refresh);
  return { show: refresh, open };
}
