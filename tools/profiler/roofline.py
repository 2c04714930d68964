"""FLOPs and bytes of one engine step, from a model's shape: what a roofline times.

Per layer, for n new tokens (a prefill chunk at offset o, or a decode batch of n sequences):

- projections: 2 FLOPs per weight per token. Attention has q and o (hidden x heads*head_dim)
  and k and v (hidden x kv_heads*head_dim): grouped-query attention shrinks k and v, not q.
- MLP: gate, up and down (3 x hidden x intermediate). An MoE layer runs a router
  (hidden x experts) and, per token, `experts_per_token` experts plus any shared expert; its
  FLOPs count only those, while its bytes count every expert the step's tokens touch (with
  uniform routing, E * (1 - (1 - k/E)^n) distinct experts for n tokens).
- attention over positions: QK^T and PV are 2 * heads * head_dim FLOPs each per (query,
  position) pair; `attended` is the number of such pairs (see `costmodel.chunk_plan`).
- bytes: every weight the step uses is read once (the step's tokens share the read), the KV
  of every position attended is read once and the new tokens' KV written once.

The head (hidden x vocab) runs for the rows that sample: one per finished prompt chunk, one
per decode sequence. Embedding lookups, norms and activations are left out: they are n *
hidden-sized, a rounding error beside the weights and the KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.replica_profile import touched_fraction
from tools.profiler.model_shape import ModelShape


@dataclass(frozen=True)
class StepCost:
    flops: float  # all of them, attention's included
    weight_bytes: float
    kv_bytes: float
    # QK^T and PV over the attended positions: a different kernel from the weight GEMMs
    # (scores, softmax and a paged gather on a CPU), whose rate is calibrated on its own.
    attention_flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Precision:
    weight_bytes: float  # per parameter: 2 for bf16, 1 for fp8, 0.5 for 4-bit
    kv_bytes: float = 2.0  # per KV element


def attention_params(shape: ModelShape) -> int:
    q_and_o = 2 * shape.hidden_size * shape.num_heads * shape.head_dim
    k_and_v = 2 * shape.hidden_size * shape.num_kv_heads * shape.head_dim
    return q_and_o + k_and_v


def expert_params(shape: ModelShape) -> int:
    return 3 * shape.hidden_size * shape.expert_intermediate_size


def kv_bytes_per_token(shape: ModelShape, precision: Precision) -> float:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * precision.kv_bytes


def experts_touched(shape: ModelShape, tokens: float) -> float:
    """Expected distinct routed experts n tokens run in one MoE layer (uniform routing)."""
    e, k = shape.num_experts, shape.experts_per_token
    return e * touched_fraction(e, k, tokens)


def step_cost(
    shape: ModelShape,
    precision: Precision,
    new_tokens: float,
    attended: float,
    kv_read_positions: float,
    head_rows: float,
) -> StepCost:
    """One engine step computing `new_tokens` tokens that attend to `attended` (query,
    position) pairs in all, reading the KV of `kv_read_positions` positions."""
    h = shape.hidden_size
    attn = attention_params(shape)
    dense_mlp = 3 * h * shape.intermediate_size
    flops_per_token = shape.dense_layers * (attn + dense_mlp)
    weights = shape.dense_layers * (attn + dense_mlp)
    if shape.is_moe:
        router = h * shape.num_experts
        shared = 3 * h * shape.shared_expert_intermediate_size
        active = router + shared + shape.experts_per_token * expert_params(shape)
        flops_per_token += shape.moe_layers * (attn + active)
        touched = experts_touched(shape, new_tokens) * expert_params(shape)
        weights += shape.moe_layers * (attn + router + shared + touched)
    head = h * shape.vocab_size
    attention = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attended
    flops = 2.0 * flops_per_token * new_tokens + 2.0 * head * head_rows + attention
    kv_per_token = kv_bytes_per_token(shape, precision)
    return StepCost(
        flops=flops,
        weight_bytes=(weights + head) * precision.weight_bytes,
        kv_bytes=kv_per_token * (kv_read_positions + new_tokens),
        attention_flops=attention,
    )


def prefill_chunk_cost(
    shape: ModelShape, precision: Precision, tokens: int, offset: int
) -> StepCost:
    """A prompt chunk of `tokens` new tokens after `offset` already in the KV (cached or
    computed by earlier chunks); its last row samples."""
    attended = tokens * (offset + tokens / 2)
    return step_cost(shape, precision, tokens, attended, offset, head_rows=1)


def decode_step_cost(
    shape: ModelShape, precision: Precision, batch: int, context_sum: float
) -> StepCost:
    """One token for each of `batch` sequences whose contexts sum to `context_sum`."""
    return step_cost(shape, precision, batch, context_sum, context_sum, head_rows=batch)


def model_params(shape: ModelShape) -> int:
    """Every weight of the model, all experts included (what a replica's memory holds),
    without the input embedding when the head has its own copy (the lookup is a gather)."""
    h = shape.hidden_size
    attn = attention_params(shape)
    total = shape.dense_layers * (attn + 3 * h * shape.intermediate_size)
    if shape.is_moe:
        experts = shape.num_experts * expert_params(shape)
        shared = 3 * h * shape.shared_expert_intermediate_size
        total += shape.moe_layers * (attn + h * shape.num_experts + shared + experts)
    return total + h * shape.vocab_size * (1 if shape.tie_embeddings else 2)
