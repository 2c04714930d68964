"""A sparse MLP: the expert gate picks each token's top-k experts, then the experts run over
their rows, grouped.

Tokens are sorted by the expert they were sent to, so each expert runs one matmul over all
of its rows (a Python loop over experts, never over tokens), and the weighted outputs are
scattered back with one index_add. Expert selection follows transformers: softmax in fp32
over all experts, top-k, renormalised to sum to 1 when the config says so. Each call adds to a per-
expert load counter (`load`), which the engine exports as a metric.

The grouped expert computation runs on the torch path (each expert's Linears, any weight
format), or, on a GPU with fp32 weights, as the Triton fused-MoE kernels over stacked
weights (kernels/triton_moe.py) — the same contract, so expert selection and scatter are shared.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.model.linear import Linear
from kernels.moe_experts import activate
from shared.modelfile.config import Activation

ExpertsKernel = Literal["torch", "triton"]


def gated_mlp(
    x: torch.Tensor, gate_up: Linear, down: Linear, inter: int, activation: Activation
) -> torch.Tensor:
    h = gate_up(x)
    return down(activate(h[:, :inter], activation) * h[:, inter:])


class SparseMLP:
    def __init__(
        self,
        expert_gate: torch.Tensor,  # [experts, hidden]
        experts: list[tuple[Linear, Linear]],  # per expert: (gate_up, down)
        expert_intermediate: int,
        top_k: int,
        normalise: bool,
        activation: Activation,
        shared: tuple[Linear, Linear, int] | None = None,  # (gate_up, down, intermediate)
        shared_gate: torch.Tensor | None = None,  # [1, hidden]
        kernel: ExpertsKernel = "torch",
    ):
        self.expert_gate = expert_gate
        self.experts = experts
        self.inter = expert_intermediate
        self.top_k = top_k
        self.normalise = normalise
        self.activation: Activation = activation
        self.shared = shared
        self.shared_gate = shared_gate
        self.load = torch.zeros(len(experts), dtype=torch.long)
        self.kernel: ExpertsKernel = kernel
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        if kernel == "triton":
            # The Triton kernels read every expert from one fp32 tensor per projection.
            if any(m.fp32 is None for pair in experts for m in pair):
                raise ValueError("the Triton expert kernels take fp32 expert weights")
            self._stacked = (
                torch.stack([gu.fp32 for gu, _ in experts]),  # type: ignore[misc]
                torch.stack([d.fp32 for _, d in experts]),  # type: ignore[misc]
            )

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] fp32, expert ids [n, k])."""
        probs = torch.softmax((x @ self.expert_gate.T).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.load += counts.cpu()
        grouped = x[token_of]
        row_weights = weights.reshape(-1)[order]
        if self._stacked is not None:
            from kernels.triton_moe import grouped_experts

            scaled = grouped_experts(
                grouped, counts.tolist(), *self._stacked, row_weights, self.activation
            )
        else:
            scaled = self._torch_experts(grouped, counts.tolist(), row_weights)
        y = torch.zeros_like(x).index_add_(0, token_of, scaled)
        if self.shared is not None:
            gate_up, down, inter = self.shared
            shared_out = gated_mlp(x, gate_up, down, inter, self.activation)
            if self.shared_gate is not None:
                shared_out = torch.sigmoid(x @ self.shared_gate.T) * shared_out
            y = y + shared_out
        return y

    def _torch_experts(
        self, grouped: torch.Tensor, counts: list[int], row_weights: torch.Tensor
    ) -> torch.Tensor:
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                gate_up, down = self.experts[expert]
                rows = slice(start, start + count)
                outputs[rows] = gated_mlp(grouped[rows], gate_up, down, self.inter, self.activation)
                start += count
        return outputs * row_weights[:, None].to(outputs.dtype)
