from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    STORE: _ClassVar[Direction]
    LOAD: _ClassVar[Direction]

class LaneKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_TRANSFER_JOBS: _ClassVar[LaneKind]
    LANE_PINS: _ClassVar[LaneKind]
    LANE_UNPINS: _ClassVar[LaneKind]
DIRECTION_UNSPECIFIED: Direction
STORE: Direction
LOAD: Direction
LANE_TRANSFER_JOBS: LaneKind
LANE_PINS: LaneKind
LANE_UNPINS: LaneKind

class SessionRequest(_message.Message):
    __slots__ = ("client_name", "pid", "engine_id")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    engine_id: str
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("hello", "keepalive")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    keepalive: SessionKeepalive
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., keepalive: _Optional[_Union[SessionKeepalive, _Mapping]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("session_id", "boot_id", "version", "pool_capacity_bytes", "max_job_keys", "fd_socket", "remote_tier", "shard", "shard_count", "eviction_policy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_JOB_KEYS_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    boot_id: str
    version: str
    pool_capacity_bytes: int
    max_job_keys: int
    fd_socket: str
    remote_tier: bool
    shard: int
    shard_count: int
    eviction_policy: str
    def __init__(self, session_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., version: _Optional[str] = ..., pool_capacity_bytes: _Optional[int] = ..., max_job_keys: _Optional[int] = ..., fd_socket: _Optional[str] = ..., remote_tier: _Optional[bool] = ..., shard: _Optional[int] = ..., shard_count: _Optional[int] = ..., eviction_policy: _Optional[str] = ...) -> None: ...

class SessionKeepalive(_message.Message):
    __slots__ = ("uptime_seconds", "pool_used_bytes", "pool_writing_bytes", "pool_pinned_bytes")
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_WRITING_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    uptime_seconds: float
    pool_used_bytes: int
    pool_writing_bytes: int
    pool_pinned_bytes: int
    def __init__(self, uptime_seconds: _Optional[float] = ..., pool_used_bytes: _Optional[int] = ..., pool_writing_bytes: _Optional[int] = ..., pool_pinned_bytes: _Optional[int] = ...) -> None: ...

class NamespaceLayout(_message.Message):
    __slots__ = ("id", "world_size", "blocks_per_chunk", "groups", "description", "group_ids", "digest_inputs")
    ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_INPUTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    world_size: int
    blocks_per_chunk: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupLayout]
    description: str
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    digest_inputs: str
    def __init__(self, id: _Optional[str] = ..., world_size: _Optional[int] = ..., blocks_per_chunk: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupLayout, _Mapping]]] = ..., description: _Optional[str] = ..., group_ids: _Optional[_Iterable[int]] = ..., digest_inputs: _Optional[str] = ...) -> None: ...

class GroupLayout(_message.Message):
    __slots__ = ("layer_page_bytes",)
    LAYER_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer_page_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer_page_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "pvm")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PVM_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    pvm: ProcessMemory
    def __init__(self, shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., pvm: _Optional[_Union[ProcessMemory, _Mapping]] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("fd_token", "size")
    FD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    fd_token: str
    size: int
    def __init__(self, fd_token: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("ipc_handle", "device_uuid", "offset", "size", "event_handle", "gpu_token")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GPU_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device_uuid: str
    offset: int
    size: int
    event_handle: bytes
    gpu_token: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., gpu_token: _Optional[str] = ...) -> None: ...

class ProcessMemory(_message.Message):
    __slots__ = ("pid", "address", "size", "pid_token")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pid: int
    address: int
    size: int
    pid_token: str
    def __init__(self, pid: _Optional[int] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., pid_token: _Optional[str] = ...) -> None: ...

class KVTensor(_message.Message):
    __slots__ = ("region_index", "region_offset", "num_blocks", "block_stride_bytes", "page_bytes")
    REGION_INDEX_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_index: int
    region_offset: int
    num_blocks: int
    block_stride_bytes: int
    page_bytes: int
    def __init__(self, region_index: _Optional[int] = ..., region_offset: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class LayerRef(_message.Message):
    __slots__ = ("tensor_index", "page_offset", "page_bytes")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    page_offset: int
    page_bytes: int
    def __init__(self, tensor_index: _Optional[int] = ..., page_offset: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class GroupRefs(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerRef]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerRef, _Mapping]]] = ...) -> None: ...

class RegisterKVRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "rank", "regions", "tensors", "groups", "unit_count")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    UNIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: NamespaceLayout
    rank: int
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    tensors: _containers.RepeatedCompositeFieldContainer[KVTensor]
    groups: _containers.RepeatedCompositeFieldContainer[GroupRefs]
    unit_count: int
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceLayout, _Mapping]] = ..., rank: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[KVTensor, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupRefs, _Mapping]]] = ..., unit_count: _Optional[int] = ...) -> None: ...

class RegisterKVResponse(_message.Message):
    __slots__ = ("registration_id", "memory_path", "slot_bytes")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    memory_path: str
    slot_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, registration_id: _Optional[int] = ..., memory_path: _Optional[str] = ..., slot_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class UnregisterKVRequest(_message.Message):
    __slots__ = ("session_id", "registration_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    registration_id: int
    def __init__(self, session_id: _Optional[str] = ..., registration_id: _Optional[int] = ...) -> None: ...

class UnregisterKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "key_events")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    key_events: bool
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., key_events: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "keys", "reset", "reason", "boot_id", "tier", "key_events")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        SNAPSHOT: _ClassVar[WatchEvent.Kind]
        SNAPSHOT_END: _ClassVar[WatchEvent.Kind]
        STORED: _ClassVar[WatchEvent.Kind]
        REMOVED: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    SNAPSHOT: WatchEvent.Kind
    SNAPSHOT_END: WatchEvent.Kind
    STORED: WatchEvent.Kind
    REMOVED: WatchEvent.Kind
    class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TIER_POOL: _ClassVar[WatchEvent.Tier]
        TIER_DISK: _ClassVar[WatchEvent.Tier]
    TIER_POOL: WatchEvent.Tier
    TIER_DISK: WatchEvent.Tier
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    reset: bool
    reason: str
    boot_id: str
    tier: WatchEvent.Tier
    key_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., reset: _Optional[bool] = ..., reason: _Optional[str] = ..., boot_id: _Optional[str] = ..., tier: _Optional[_Union[WatchEvent.Tier, str]] = ..., key_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ready: _Optional[_Iterable[bool]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned",)
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, pinned: _Optional[_Iterable[bool]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "touch_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    touch_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., touch_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("not_pinned",)
    NOT_PINNED_FIELD_NUMBER: _ClassVar[int]
    not_pinned: int
    def __init__(self, not_pinned: _Optional[int] = ...) -> None: ...

class TransferJob(_message.Message):
    __slots__ = ("job_id", "direction", "registration_id", "keys", "block_ids", "group_sizes", "block_indices", "expedited", "session_id", "key_events")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    EXPEDITED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    direction: Direction
    registration_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    expedited: bool
    session_id: str
    key_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, job_id: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., registration_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ..., block_indices: _Optional[_Iterable[int]] = ..., expedited: _Optional[bool] = ..., session_id: _Optional[str] = ..., key_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ChunkEvent(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx", "has_lora", "lora_id", "lora_name", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    HAS_LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    group_idx: int
    has_lora: bool
    lora_id: int
    lora_name: str
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., group_idx: _Optional[int] = ..., has_lora: _Optional[bool] = ..., lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("job_id", "success", "bytes", "copy_seconds", "total_seconds", "error", "stored_keys", "present_keys", "dropped_keys", "drop_reason", "error_code")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STORED_KEYS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DROP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    success: bool
    bytes: int
    copy_seconds: float
    total_seconds: float
    error: str
    stored_keys: int
    present_keys: int
    dropped_keys: int
    drop_reason: str
    error_code: str
    def __init__(self, job_id: _Optional[int] = ..., success: _Optional[bool] = ..., bytes: _Optional[int] = ..., copy_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., error: _Optional[str] = ..., stored_keys: _Optional[int] = ..., present_keys: _Optional[int] = ..., dropped_keys: _Optional[int] = ..., drop_reason: _Optional[str] = ..., error_code: _Optional[str] = ...) -> None: ...

class OpenJobLaneRequest(_message.Message):
    __slots__ = ("session_id", "fd_token", "kind", "batched_results")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BATCHED_RESULTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fd_token: str
    kind: LaneKind
    batched_results: bool
    def __init__(self, session_id: _Optional[str] = ..., fd_token: _Optional[str] = ..., kind: _Optional[_Union[LaneKind, str]] = ..., batched_results: _Optional[bool] = ...) -> None: ...

class OpenJobLaneResponse(_message.Message):
    __slots__ = ("lane_id", "max_job_bytes", "batched_results")
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_JOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_RESULTS_FIELD_NUMBER: _ClassVar[int]
    lane_id: int
    max_job_bytes: int
    batched_results: bool
    def __init__(self, lane_id: _Optional[int] = ..., max_job_bytes: _Optional[int] = ..., batched_results: _Optional[bool] = ...) -> None: ...

class TransferResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TransferResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TransferResult, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "key", "rank", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    key: bytes
    rank: int
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., key: _Optional[bytes] = ..., rank: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("outcome", "ready", "drop_reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DROP_REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    ready: bool
    drop_reason: str
    def __init__(self, outcome: _Optional[str] = ..., ready: _Optional[bool] = ..., drop_reason: _Optional[str] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "key", "rank")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    key: bytes
    rank: int
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., key: _Optional[bytes] = ..., rank: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("states", "remote_tier", "remote_healthy", "from_disk")
    class KeyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KEY_STATE_UNSPECIFIED: _ClassVar[PrefetchResponse.KeyState]
        LOCAL: _ClassVar[PrefetchResponse.KeyState]
        FETCHING: _ClassVar[PrefetchResponse.KeyState]
        ABSENT: _ClassVar[PrefetchResponse.KeyState]
    KEY_STATE_UNSPECIFIED: PrefetchResponse.KeyState
    LOCAL: PrefetchResponse.KeyState
    FETCHING: PrefetchResponse.KeyState
    ABSENT: PrefetchResponse.KeyState
    STATES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FROM_DISK_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[PrefetchResponse.KeyState]
    remote_tier: bool
    remote_healthy: bool
    from_disk: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, states: _Optional[_Iterable[_Union[PrefetchResponse.KeyState, str]]] = ..., remote_tier: _Optional[bool] = ..., remote_healthy: _Optional[bool] = ..., from_disk: _Optional[_Iterable[bool]] = ...) -> None: ...
