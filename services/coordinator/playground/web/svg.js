// SVG elements by attribute (no markup strings: nothing from a response is parsed as HTML).

const NS = "http://www.w3.org/2000/svg";

export function svg(tag, attributes = {}, text = null) {
  const el = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attributes)) el.setAttribute(name, String(value));
  if (text != null) el.textContent = text;
  return el;
}
