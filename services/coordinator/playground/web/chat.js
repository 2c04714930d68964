// The chat view: a conversation whose whole history is resent every turn, as apps do.

import { messageItem, streamReply } from "./reply.js";

const $ = (id) => document.getElementById(id);

// The sampling settings of the Chat view, shared with Compare.
export function requestSettings() {
  const body = {};
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const seed = $("seed").value;
  if (seed !== "") body.seed = Number(seed);
  return body;
}

export function withSystemPrompt(history) {
  const system = $("system-prompt").value.trim();
  return system ? [{ role: "system", content: system }, ...history] : [...history];
}

// Enter sends, Shift+Enter is a new line, Escape stops: the composer without a mouse.
export function composerKeys(textarea, form, stopButton) {
  textarea.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    } else if (event.key === "Escape" && !stopButton.disabled) {
      event.preventDefault();
      stopButton.click();
    }
  });
}

export function setupChat({ onTrace }) {
  const history = [];
  const list = $("messages");
  const form = $("composer");
  const prompt = $("prompt");
  const send = $("send");
  const stop = $("stop");
  let controller = null;

  composerKeys(prompt, form, stop);
  stop.addEventListener("click", () => controller && controller.abort());
  $("clear-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    list.replaceChildren();
    prompt.focus();
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const content = prompt.value.trim();
    if (!content || controller) return;
    history.push({ role: "user", content });
    messageItem(list, "user", content);
    prompt.value = "";
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    const request = {
      model: $("model").value,
      service_tier: $("tier").value,
      messages: withSystemPrompt(history),
      ...requestSettings(),
    };
    const reply = await streamReply(list, request, controller, onTrace);
    controller = null;
    send.disabled = false;
    stop.disabled = true;
    if (reply.error && !reply.text) {
      history.pop(); // the turn never happened (its item shows why): it can be sent again
    } else {
      history.push({ role: "assistant", content: reply.text });
    }
    prompt.focus();
  });
}
