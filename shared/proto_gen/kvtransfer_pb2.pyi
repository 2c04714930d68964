from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATUS_UNSPECIFIED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_PENDING: _ClassVar[TransferStatus]
    TRANSFER_STATUS_DONE: _ClassVar[TransferStatus]
    TRANSFER_STATUS_FAILED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_TIMED_OUT: _ClassVar[TransferStatus]
    TRANSFER_STATUS_ABORTED: _ClassVar[TransferStatus]
TRANSFER_STATUS_UNSPECIFIED: TransferStatus
TRANSFER_STATUS_PENDING: TransferStatus
TRANSFER_STATUS_DONE: TransferStatus
TRANSFER_STATUS_FAILED: TransferStatus
TRANSFER_STATUS_TIMED_OUT: TransferStatus
TRANSFER_STATUS_ABORTED: TransferStatus

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class AgentMetadata(_message.Message):
    __slots__ = ("backend", "agent_name", "layout", "num_blocks", "payload", "replica")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    backend: str
    agent_name: str
    layout: KVLayout
    num_blocks: int
    payload: bytes
    replica: str
    def __init__(self, backend: _Optional[str] = ..., agent_name: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., payload: _Optional[bytes] = ..., replica: _Optional[str] = ...) -> None: ...

class BlockDescriptor(_message.Message):
    __slots__ = ("block_id", "addr", "nbytes")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    addr: int
    nbytes: int
    def __init__(self, block_id: _Optional[int] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PrepareReceiveRequest(_message.Message):
    __slots__ = ("request_id", "num_blocks", "layout", "sender", "deadline_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_blocks: int
    layout: KVLayout
    sender: AgentMetadata
    deadline_s: float
    def __init__(self, request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., sender: _Optional[_Union[AgentMetadata, _Mapping]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class PrepareReceiveResponse(_message.Message):
    __slots__ = ("receiver", "blocks")
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    receiver: AgentMetadata
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDescriptor]
    def __init__(self, receiver: _Optional[_Union[AgentMetadata, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockDescriptor, _Mapping]]] = ...) -> None: ...

class TransferDoneRequest(_message.Message):
    __slots__ = ("request_id", "status", "error", "nbytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: TransferStatus
    error: str
    nbytes: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[TransferStatus, str]] = ..., error: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TransferDoneResponse(_message.Message):
    __slots__ = ("receiver_status", "error")
    RECEIVER_STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    receiver_status: TransferStatus
    error: str
    def __init__(self, receiver_status: _Optional[_Union[TransferStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
