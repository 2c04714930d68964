"""Which local topology `splitserve up` runs when no config says: colocated or disaggregated.

Disaggregation gives prefill and decode their own cores; on a small machine that means a
person chatting alone gets only part of the box for every step. Measured on a 2-core machine
(this project's development box): the native decode step takes 3.4 ms with two threads and
6.1 ms with one (1.8x), and a prefill chunk scales about the same, so one `both` replica on
every core serves a lone stream ~1.8x faster than one prefill + one decode replica of one
core each. Splitting pays once each role's share still has several cores (prefill then never
stalls the decode batch and neither halves the other's threads), taken here as 8 cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.schema import DeploymentConfig, PoolsConfig

MIN_CPUS_TO_DISAGGREGATE = 8


@dataclass(frozen=True)
class Topology:
    config: DeploymentConfig
    reason: str


def local_topology(
    config: DeploymentConfig, cpus: int, disaggregated: bool | None = None
) -> Topology:
    """The built-in config's pools for this machine (None: decide by its cores)."""
    split = cpus >= MIN_CPUS_TO_DISAGGREGATE if disaggregated is None else disaggregated
    if split:
        pools = PoolsConfig(prefill=1, decode=1, both=0)
        why = (
            "asked for (--disaggregated)"
            if disaggregated
            else f"{cpus} cores: each role keeps {cpus // 2} of them"
        )
        reason = f"1 prefill + 1 decode replica, {max(1, cpus // 2)} threads each: {why}"
    else:
        pools = PoolsConfig(prefill=0, decode=0, both=1)
        why = (
            "asked for (--colocated)"
            if disaggregated is False
            else f"{cpus} cores (< {MIN_CPUS_TO_DISAGGREGATE}): splitting them would give a "
            "lone chat stream half the machine; --disaggregated splits anyway"
        )
        reason = f"1 colocated replica (prefill + decode), {cpus} threads: {why}"
    models = [m.model_copy(update={"pools": pools}) for m in config.models]
    return Topology(config.model_copy(update={"models": models}), reason)
