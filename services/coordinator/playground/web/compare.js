// Compare: the same conversation to two models, routers or tiers, side by side. Each side
// keeps its own replies in its history, so each sees the conversation as it would in an app.

import { composerKeys, requestSettings, withSystemPrompt } from "./chat.js";
import { messageItem, streamReply } from "./reply.js";

const $ = (id) => document.getElementById(id);

export function setupCompare({ onTrace }) {
  const sides = ["a", "b"].map((name) => ({
    name,
    history: [],
    list: $(`compare-messages-${name}`),
    model: $(`compare-model-${name}`),
    tier: $(`compare-tier-${name}`),
  }));
  const form = $("compare-composer");
  const prompt = $("compare-prompt");
  const send = $("compare-send");
  const stop = $("compare-stop");
  const errorEl = $("compare-error");
  let controller = null;

  composerKeys(prompt, form, stop);
  stop.addEventListener("click", () => controller && controller.abort());
  $("compare-clear").addEventListener("click", () => {
    if (controller) controller.abort();
    for (const side of sides) {
      side.history.length = 0;
      side.list.replaceChildren();
    }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const content = prompt.value.trim();
    if (!content || controller) return;
    errorEl.hidden = true;
    prompt.value = "";
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    const settings = requestSettings();
    const replies = sides.map((side) => {
      side.history.push({ role: "user", content });
      messageItem(side.list, "user", content);
      const request = {
        model: side.model.value,
        service_tier: side.tier.value,
        messages: withSystemPrompt(side.history),
        ...settings,
      };
      return streamReply(side.list, request, controller, onTrace);
    });
    const done = await Promise.all(replies);
    done.forEach((reply, i) => {
      if (reply.error && !reply.text) sides[i].history.pop();
      else sides[i].history.push({ role: "assistant", content: reply.text });
    });
    const failed = done.filter((r) => r.error);
    if (failed.length) {
      errorEl.textContent = failed.map((r) => r.error.message).join("; ");
      errorEl.hidden = false;
    }
    controller = null;
    send.disabled = false;
    stop.disabled = true;
    prompt.focus();
  });
}
