from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop_token_ids", "max_tokens", "ignore_eos", "logprobs", "structured")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "schema_json", "replay_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    schema_json: str
    replay_tokens: int
    def __init__(self, kind: _Optional[str] = ..., schema_json: _Optional[str] = ..., replay_tokens: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "priority", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    priority: int
    prompt_logprobs: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., priority: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("control_address", "agent_name", "deadline_s")
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    control_address: str
    agent_name: str
    deadline_s: float
    def __init__(self, control_address: _Optional[str] = ..., agent_name: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("generation", "destination")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    generation: Generation
    destination: KVDestination
    def __init__(self, generation: _Optional[_Union[Generation, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class TransferOutcome(_message.Message):
    __slots__ = ("status", "error", "nbytes", "seconds", "backend", "num_blocks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    status: str
    error: str
    nbytes: int
    seconds: float
    backend: str
    num_blocks: int
    def __init__(self, status: _Optional[str] = ..., error: _Optional[str] = ..., nbytes: _Optional[int] = ..., seconds: _Optional[float] = ..., backend: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("first_token", "logprob", "has_logprob", "num_prompt_tokens", "num_cached_tokens", "queue_ms", "prefill_ms", "finished", "finish_reason", "replica", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: TokenLogprob
    has_logprob: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    finished: bool
    finish_reason: str
    replica: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., has_logprob: _Optional[bool] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., replica: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    first_token: PrefillFirstToken
    transfer: TransferOutcome
    def __init__(self, first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., transfer: _Optional[_Union[TransferOutcome, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("generation", "kv_transferred", "first_token", "kv_deadline_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    generation: Generation
    kv_transferred: bool
    first_token: int
    kv_deadline_s: float
    def __init__(self, generation: _Optional[_Union[Generation, _Mapping]] = ..., kv_transferred: _Optional[bool] = ..., first_token: _Optional[int] = ..., kv_deadline_s: _Optional[float] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "token_time_ms", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "local_prefill", "kv_wait_ms", "prompt_logprobs", "handed_over")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    token_time_ms: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    local_prefill: bool
    kv_wait_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    handed_over: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., token_time_ms: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., kv_wait_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., handed_over: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "queued_prefill_tokens", "active_kv_tokens", "free_blocks", "total_blocks")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    queued_prefill_tokens: int
    active_kv_tokens: int
    free_blocks: int
    total_blocks: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., active_kv_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "role", "model", "tokenizer_fingerprint", "block_size", "address", "max_model_len", "load", "transfer_backend", "transfer_agent", "weights", "metrics_address", "replica")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_AGENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    tokenizer_fingerprint: str
    block_size: int
    address: str
    max_model_len: int
    load: WorkerLoad
    transfer_backend: str
    transfer_agent: bytes
    weights: str
    metrics_address: str
    replica: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., address: _Optional[str] = ..., max_model_len: _Optional[int] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., transfer_backend: _Optional[str] = ..., transfer_agent: _Optional[bytes] = ..., weights: _Optional[str] = ..., metrics_address: _Optional[str] = ..., replica: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "kv_event_seq", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    kv_event_seq: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., kv_event_seq: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "resync_from_seq")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    known: bool
    resync_from_seq: int
    def __init__(self, known: _Optional[bool] = ..., resync_from_seq: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "kv_tier", "seq")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    kv_tier: str
    seq: int
    def __init__(self, kind: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., kv_tier: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "events", "snapshot")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    snapshot: bool
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KVEventAck(_message.Message):
    __slots__ = ("last_seq",)
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    last_seq: int
    def __init__(self, last_seq: _Optional[int] = ...) -> None: ...
