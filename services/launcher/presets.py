"""Small loopback deployments for tests and benchmarks of the local stack.

Heartbeats every 0.5 s with a 2 s timeout (a silent worker leaves the pool quickly), shared
memory for KV transfer (every process is on this host), small KV pools and one thread per
worker (several workers share a small machine).
"""

from __future__ import annotations

from shared.modelfile.default import DEFAULT_MODEL_ID

# Free ports, fast heartbeats.
LOOPBACK_COORDINATOR = {
    "port": 0,
    "registry_port": 0,
    "heartbeat_interval_s": 0.5,
    "heartbeat_timeout_s": 2.0,
}


def loopback_config(pools: dict[str, int] | None = None, weights: str = "fp32") -> dict:
    """A raw config (for parse_config) with free ports and the bundled model in `pools`."""
    return {
        "coordinator": dict(LOOPBACK_COORDINATOR),
        "transfer": {"backend": "shm"},
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": pools or {"prefill": 1, "decode": 1},
                "worker": {"kv_cache_bytes": 64 << 20, "host_cache_bytes": 32 << 20, "threads": 1},
            }
        ],
    }
