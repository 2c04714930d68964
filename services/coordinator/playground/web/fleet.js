// The fleet view: every worker by model and role, refreshed once a second while shown.

import { getJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
const pct = (v) => (v == null ? "–" : `${(100 * v).toFixed(1)}%`);

const COLUMNS = [
  ["worker", "worker"],
  ["role", "role"],
  ["state", "state"],
  ["load", "running / waiting"],
  ["queued", "queued prefill tok"],
  ["kv", "KV cache (device)"],
  ["host", "host tier"],
  ["disk", "disk tier"],
  ["hit-rate", "prefix hit rate"],
  ["spec", "spec. acceptance"],
  ["heartbeat", "last heartbeat"],
];

function tierCell(tier) {
  if (!tier) return "off";
  return `${pct(tier.usage)} (${tier.used_blocks}/${tier.capacity_blocks})`;
}

function cells(w) {
  const spec = w.speculative;
  return {
    worker: w.worker_id,
    role: w.role,
    state: w.state,
    load: `${w.load.running} / ${w.load.waiting}`,
    queued: String(w.load.queued_prefill_tokens),
    kv: pct(w.kv_cache_usage),
    host: tierCell(w.kv_tiers.host),
    disk: tierCell(w.kv_tiers.disk),
    "hit-rate": pct(w.prefix_cache_hit_rate),
    spec: spec ? `${pct(spec.acceptance_rate)} (${spec.method})` : "off",
    heartbeat: `${w.last_heartbeat_s_ago.toFixed(1)} s ago`,
  };
}

function table(model) {
  const section = document.createElement("section");
  section.className = "panel fleet-model";
  const h = document.createElement("h2");
  h.textContent = `${model.id}: ${model.serving_workers} of ${model.expected_workers} workers serving`;
  const t = document.createElement("table");
  const head = t.createTHead().insertRow();
  for (const [, label] of COLUMNS) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = label;
    head.append(th);
  }
  const body = t.createTBody();
  for (const w of model.workers) {
    const row = body.insertRow();
    row.className = `worker state-${w.state}`;
    row.dataset.workerId = w.worker_id;
    const values = cells(w);
    for (const [key] of COLUMNS) {
      const td = row.insertCell();
      td.dataset.column = key;
      td.textContent = values[key];
    }
    if (w.stats_error) row.title = w.stats_error;
  }
  section.append(h, t);
  return section;
}

export function setupFleet() {
  let timer = null;
  const errorEl = $("fleet-error");

  async function refresh() {
    try {
      const fleet = await getJSON("/playground/api/fleet");
      $("fleet").replaceChildren(...fleet.models.map(table));
      const all = fleet.models.flatMap((m) => m.workers);
      const down = all.filter((w) => w.state !== "serving").length;
      const at = new Date(fleet.time * 1000).toLocaleTimeString();
      $("fleet-summary").textContent =
        `${all.length} workers, ${down} not serving; ${fleet.ready ? "ready" : "not ready"} (as of ${at})`;
      errorEl.hidden = true;
    } catch (exc) {
      errorEl.textContent = exc.message;
      errorEl.hidden = false;
    }
  }

  function schedule(visible) {
    clearInterval(timer);
    timer = null;
    if (visible && $("fleet-live").checked) timer = setInterval(refresh, 1000);
  }

  $("fleet-live").addEventListener("change", () => schedule(true));
  return {
    show() {
      refresh();
      schedule(true);
    },
    hide() {
      schedule(false);
    },
  };
}
