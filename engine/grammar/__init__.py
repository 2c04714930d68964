"""Constrained decoding: structured outputs compiled to grammars (llguidance) and the per-step
token masks that keep a request's output inside its grammar. Worker-side only: the
coordinator sends the schema as text and never imports this package."""
