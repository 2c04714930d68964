"""Serving the OpenAI surface from one engine inside the calling process (tests, one-box runs).

Outside `services.coordinator` on purpose: it imports the engine (torch, the model), which the
coordinator process must never load. Whoever wants it imports it explicitly.
"""
