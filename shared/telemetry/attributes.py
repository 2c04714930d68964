"""Span attribute names: the OpenTelemetry GenAI semantic conventions, then our own.

Ours live under `splitserve.` so a tracing backend can tell them from the conventions. Prompt
and completion text go only under the two `*_MESSAGES` keys, and only when the operator turns
`telemetry.capture_content` on.
"""

from __future__ import annotations

# -- GenAI semantic conventions ------------------------------------------------------------
OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
SYSTEM = "gen_ai.system"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICES = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"  # content: only with capture_content
OUTPUT_MESSAGES = "gen_ai.output.messages"  # content: only with capture_content

SYSTEM_NAME = "splitserve"

# -- HTTP / RPC conventions ----------------------------------------------------------------
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS = "rpc.grpc.status_code"
SERVER_ADDRESS = "server.address"
ERROR_TYPE = "error.type"

# -- ours ----------------------------------------------------------------------------------
TIER = "splitserve.tier"
STREAM = "splitserve.stream"
REPLICA = "splitserve.replica"
ROLE = "splitserve.role"
PREFILL_REPLICA = "splitserve.route.prefill_replica"
DECODE_REPLICA = "splitserve.route.decode_replica"
ROUTE_MODE = "splitserve.route.mode"  # disaggregated | colocated
ROUTE_REASONING = "splitserve.route.reasoning"
CACHED_TOKENS = "splitserve.cached_tokens"
COMPUTED_TOKENS = "splitserve.computed_tokens"
CHUNK_INDEX = "splitserve.prefill.chunk_index"
CHUNK_TOKENS = "splitserve.prefill.chunk_tokens"
BATCH_SIZE = "splitserve.batch_size"
BATCH_TOKENS = "splitserve.batch_tokens"
DECODE_STEPS = "splitserve.decode.steps"
DECODE_MEAN_BATCH = "splitserve.decode.mean_batch_size"
KV_TRANSFERRED = "splitserve.kv_transferred"
LOCAL_PREFILL = "splitserve.local_prefill"
PREEMPTIONS = "splitserve.preemptions"
TRANSFER_BACKEND = "splitserve.transfer.backend"
TRANSFER_BYTES = "splitserve.transfer.bytes"
TRANSFER_BLOCKS = "splitserve.transfer.blocks"
TRANSFER_STATUS = "splitserve.transfer.status"
TRANSFER_SECONDS = "splitserve.transfer.seconds"
TRANSFER_ERROR = "splitserve.transfer.error"
KV_WAIT_MS = "splitserve.decode.kv_wait_ms"
ACCEPTED_DRAFT_TOKENS = "splitserve.spec.accepted_draft_tokens"
FALLBACK_ATTEMPTS = "splitserve.fallback_attempts"
MIGRATIONS = "splitserve.migrations"

# Keys a backend may put on a response's `metadata` that also belong on the request's span
# (and in the request counters): the fallback, migration and speculative-decoding paths
# report through them without knowing about tracing.
METADATA_ATTRIBUTES = {
    "fallback_attempts": FALLBACK_ATTEMPTS,
    "migrations": MIGRATIONS,
    "accepted_draft_tokens": ACCEPTED_DRAFT_TOKENS,
}

# Span names.
SPAN_ROUTE = "splitserve.route"
SPAN_PREFILL = "splitserve.prefill"
SPAN_DECODE = "splitserve.decode"
SPAN_QUEUE = "splitserve.engine.queue"
SPAN_COORDINATOR_QUEUE = "splitserve.coordinator.queue"
SPAN_CHUNK = "splitserve.prefill.chunk"
SPAN_ADMISSION = "splitserve.decode.admission"
SPAN_DECODE_STEPS = "splitserve.decode.steps"
SPAN_KV_WAIT = "splitserve.decode.kv_wait"  # a Decode call waiting for KV still in flight
SPAN_TRANSFER = "splitserve.kv_transfer"

# Span event names.
EVENT_FIRST_TOKEN = "splitserve.first_token"
EVENT_STREAM_END = "splitserve.stream_end"
EVENT_HANDED_OVER = "splitserve.handed_over"  # a draining replica gave the stream up
