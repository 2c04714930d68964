"""The KV-aware router: an index of which replica holds which KV blocks, and a pipeline
(filter -> score -> pick, then the conditional-disaggregation decision) over replica states.

Nothing here talks to the network: the coordinator's registry and the fleet simulator both
feed it plain replica states, so the benchmark scores replicas with the code that ships.
"""
