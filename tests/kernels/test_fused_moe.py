"""The Triton fused-MoE experts equal the torch reference (run by Triton's interpreter)."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from kernels.moe_experts import reference_grouped_experts  # noqa: E402
from kernels.triton_moe import grouped_experts  # noqa: E402


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    ("hidden", "inter", "counts"),
    [
        (64, 32, [5, 0, 17, 1]),  # an idle expert, a run longer than one tile
        (24, 20, [3, 3, 0, 0, 7]),  # odd sizes: masked K and N edges
    ],
)
def test_grouped_experts_match_reference(activation, hidden, inter, counts):
    gen = torch.Generator().manual_seed(0)
    experts, rows = len(counts), sum(counts)
    x = torch.randn(rows, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights = torch.rand(rows, generator=gen)
    want = reference_grouped_experts(x, counts, gate_up, down, weights, activation)
    got = grouped_experts(x, counts, gate_up, down, weights, activation)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_mismatched_shapes_are_refused():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="experts"):
        grouped_experts(x, [2], torch.zeros(1, 6, 8), torch.zeros(1, 8, 4), torch.ones(2), "silu")


@pytest.mark.parametrize("shared_expert", [False, True])
def test_sparse_mlp_is_the_same_through_either_kernel(shared_expert):
    """The model's MoE layer, routed once, computed by the torch loop or the Triton kernels."""
    from engine.model.linear import Linear
    from engine.model.moe import SparseMLP

    gen = torch.Generator().manual_seed(1)
    hidden, inter, experts = 32, 16, 6

    def linear(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols, generator=gen) / cols**0.5, "fp32")

    pairs = [(linear(2 * inter, hidden), linear(hidden, inter)) for _ in range(experts)]
    expert_gate = torch.randn(experts, hidden, generator=gen)
    shared = (linear(2 * 24, hidden), linear(hidden, 24), 24) if shared_expert else None
    gate = torch.randn(1, hidden, generator=gen) if shared_expert else None
    layers = [
        SparseMLP(expert_gate, pairs, inter, 2, True, "silu", shared, gate, kernel=kernel)
        for kernel in ("torch", "triton")
    ]
    x = torch.randn(19, hidden, generator=gen)
    want, got = (layer(x) for layer in layers)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(layers[0].load, layers[1].load)
