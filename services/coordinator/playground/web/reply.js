// One streamed reply: its text as it arrives, then the figures that explain it.

import { streamChat } from "./api.js";
import { renderFigures } from "./figures.js";

export function messageItem(list, role, text) {
  const li = document.createElement("li");
  li.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  list.append(li);
  return li;
}

// Streams `request` into a new assistant item of `list`; resolves to
// {text, stopped, error} once the stream ends. `controller` aborts it.
export async function streamReply(list, request, controller, onTrace) {
  const li = messageItem(list, "assistant", "");
  li.classList.add("streaming");
  const textEl = li.querySelector(".text");
  const run = { sent: performance.now(), arrivals: [], text: "", final: null, first: null };
  let stopped = false;
  let error = null;
  try {
    await streamChat(request, controller.signal, (chunk, at) => {
      run.first = run.first || chunk;
      const choice = chunk.choices && chunk.choices[0];
      const delta = choice && choice.delta && choice.delta.content;
      if (delta) {
        run.text += delta;
        run.arrivals.push(at);
        textEl.textContent = run.text;
      }
      if (chunk.usage) run.final = chunk;
    });
  } catch (exc) {
    if (exc.name === "AbortError") stopped = true;
    else error = exc;
  }
  run.ended = performance.now();
  li.classList.remove("streaming");
  if (stopped) li.classList.add("stopped");
  if (error) {
    const p = document.createElement("p");
    p.className = "error";
    p.setAttribute("role", "alert");
    p.textContent = error.message;
    li.append(p);
  }
  if (run.first || run.final) li.append(renderFigures(run, { stopped, onTrace }));
  return { text: run.text, stopped, error };
}
