// Wiring: the key (when the coordinator needs one), the pickers, and the four views.

import { auth, getJSON } from "./api.js";
import { setupChat } from "./chat.js";
import { setupCompare } from "./compare.js";
import { setupFleet } from "./fleet.js";
import { setupTraces } from "./traces.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["chat", "compare", "fleet", "traces"];

function fillSelect(select, values, preferred) {
  const previous = select.value;
  select.replaceChildren(
    ...values.map((v) => {
      const o = document.createElement("option");
      o.value = v;
      o.textContent = v;
      return o;
    }),
  );
  if (values.includes(previous)) select.value = previous;
  else if (preferred !== undefined && values.includes(preferred)) select.value = preferred;
}

function askForKey(message) {
  $("auth").hidden = false;
  $("auth-message").textContent = message;
  $("key-status").textContent = auth.key ? "key set (rejected)" : "no key";
  $("api-key").focus();
}

async function loadPickers(config) {
  const models = await getJSON("/v1/models");
  const ids = models.data.map((m) => m.id);
  for (const id of ["model", "compare-model-a", "compare-model-b"]) fillSelect($(id), ids);
  if (ids.length > 1 && $("compare-model-b").value === ids[0]) $("compare-model-b").value = ids[1];
  for (const id of ["tier", "compare-tier-a", "compare-tier-b"]) fillSelect($(id), config.service_tiers, "auto");
  $("auth").hidden = true;
  $("key-status").textContent = config.auth_required ? "key accepted" : "no key needed";
}

function setupTabs(views) {
  const tabs = VIEWS.map((v) => $(`tab-${v}`));
  function show(name) {
    for (const v of VIEWS) {
      const active = v === name;
      $(`view-${v}`).hidden = !active;
      $(`tab-${v}`).setAttribute("aria-selected", String(active));
      $(`tab-${v}`).tabIndex = active ? 0 : -1;
      if (views[v] && !active && views[v].hide) views[v].hide();
    }
    if (views[name] && views[name].show) views[name].show();
  }
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => show(VIEWS[i]));
    // Arrow keys move between tabs, as the ARIA tabs pattern has it.
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(i + step + tabs.length) % tabs.length];
      next.focus();
      next.click();
    });
  });
  show("chat");
  return show;
}

async function start() {
  const config = await (await fetch("/playground/api/config")).json();
  const traces = setupTraces();
  const views = { fleet: setupFleet(), traces };
  const show = setupTabs(views);
  const onTrace = (traceId) => {
    show("traces");
    traces.open(traceId);
  };
  setupChat({ onTrace });
  setupCompare({ onTrace });
  auth.onUnauthorized = askForKey;

  $("auth-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    auth.key = $("api-key").value.trim();
    $("api-key").value = "";
    if (!auth.key) return askForKey("This coordinator needs an API key.");
    try {
      await loadPickers(config);
    } catch (_) {
      // a 401 has shown the key form with the API's message
    }
  });
  $("api-key-forget").addEventListener("click", () => {
    auth.key = "";
    askForKey("Key forgotten. This coordinator needs an API key.");
  });

  if (config.auth_required && !auth.key) {
    // Nothing else is sent until there is a key.
    askForKey("This coordinator needs an API key.");
    return;
  }
  try {
    await loadPickers(config);
  } catch (exc) {
    if (exc.status !== 401) {
      $("chat-error").textContent = exc.message;
      $("chat-error").hidden = false;
    }
  }
}

start();
