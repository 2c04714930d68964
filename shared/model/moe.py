"""A sparse MLP on the torch path: top-k routing, then one grouped pass per expert.

Tokens are sorted by the expert they were routed to, so each expert runs one matmul over all
of its rows (a Python loop over experts, never over tokens), and the weighted outputs are
scattered back with one index_add. Routing follows transformers: softmax in fp32 over all
experts, top-k, renormalised to sum to 1 when the config says so. Each call adds to a per-
expert load counter (`load`), which the engine exports as a metric.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.model.linear import Linear
from shared.modelfile.config import Activation


def activate(gate: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.silu(gate)


def gated_mlp(
    x: torch.Tensor, gate_up: Linear, down: Linear, inter: int, activation: Activation
) -> torch.Tensor:
    h = gate_up(x)
    return down(activate(h[:, :inter], activation) * h[:, inter:])


class SparseMLP:
    def __init__(
        self,
        router: torch.Tensor,  # [experts, hidden]
        experts: list[tuple[Linear, Linear]],  # per expert: (gate_up, down)
        expert_intermediate: int,
        top_k: int,
        normalise: bool,
        activation: Activation,
        shared: tuple[Linear, Linear, int] | None = None,  # (gate_up, down, intermediate)
        shared_gate: torch.Tensor | None = None,  # [1, hidden]
    ):
        self.router = router
        self.experts = experts
        self.inter = expert_intermediate
        self.top_k = top_k
        self.normalise = normalise
        self.activation: Activation = activation
        self.shared = shared
        self.shared_gate = shared_gate
        self.load = torch.zeros(len(experts), dtype=torch.long)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] fp32, expert ids [n, k])."""
        probs = torch.softmax((x @ self.router.T).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.load += counts
        grouped = x[token_of]
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                gate_up, down = self.experts[expert]
                rows = slice(start, start + count)
                outputs[rows] = gated_mlp(grouped[rows], gate_up, down, self.inter, self.activation)
                start += count
        scaled = outputs * weights.reshape(-1)[order, None].to(outputs.dtype)
        y = torch.zeros_like(x).index_add_(0, token_of, scaled)
        if self.shared is not None:
            gate_up, down, inter = self.shared
            shared_out = gated_mlp(x, gate_up, down, inter, self.activation)
            if self.shared_gate is not None:
                shared_out = torch.sigmoid(x @ self.shared_gate.T) * shared_out
            y = y + shared_out
        return y
