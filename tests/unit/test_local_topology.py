"""`splitserve up` without a config: the topology follows the machine's cores."""

from __future__ import annotations

from services.launcher.topology import MIN_CPUS_TO_DISAGGREGATE, local_topology
from shared.config.schema import DeploymentConfig


def _pools(topology):
    pools = topology.config.models[0].pools
    return pools.prefill, pools.decode, pools.both


def test_a_small_machine_runs_one_colocated_replica_on_every_core():
    topology = local_topology(DeploymentConfig(), cpus=2)
    assert _pools(topology) == (0, 0, 1)
    assert "2 threads" in topology.reason and "--disaggregated" in topology.reason


def test_a_big_machine_splits_prefill_and_decode():
    topology = local_topology(DeploymentConfig(), cpus=MIN_CPUS_TO_DISAGGREGATE)
    assert _pools(topology) == (1, 1, 0)


def test_disaggregation_is_one_flag_away_and_colocation_too():
    assert _pools(local_topology(DeploymentConfig(), cpus=2, disaggregated=True)) == (1, 1, 0)
    big = local_topology(DeploymentConfig(), cpus=32, disaggregated=False)
    assert _pools(big) == (0, 0, 1) and "--colocated" in big.reason
