"""The deployment config: one validated schema that `splitserve up` and the Helm chart both
produce, the engine's defaults, the coordinator's policy (service tiers, keys, prices,
saved routers) and the router's weights."""
