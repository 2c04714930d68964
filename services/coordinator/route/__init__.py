"""Where a request goes: the models it will try (saved routers, fallback), admission by
service tier, and the (prefill, decode) pair the KV-aware router picks from the registry."""
