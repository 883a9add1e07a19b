from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("version", "boot_id", "uptime_seconds", "capacity_bytes", "used_bytes", "pinned_bytes", "largest_free_extent_bytes", "warmup_done_bytes", "warmup_complete", "ready_blocks", "writing_blocks", "pinned_blocks", "sessions", "registrations", "namespaces", "lookups", "hits", "misses", "evictions", "stores", "loads", "stored_bytes", "loaded_bytes", "dropped_stores", "inflight_jobs", "pool_backing", "warm_restarted", "evictions_by_reason", "store_jobs", "load_jobs", "stored_blocks", "loaded_blocks", "failed_store_jobs", "failed_load_jobs", "pin_calls", "pin_keys", "pinned_keys", "recovery_blocks_total", "recovery_blocks_verified", "recovery_blocks_rejected", "recovery_complete", "job_lanes_open", "lane_jobs", "page_locking", "page_locked_bytes", "page_locking_error", "populating_bytes", "lane_pins", "lane_unpins", "permission_denied", "remote_enabled", "remote_healthy", "remote_writes", "remote_write_bytes", "remote_write_present", "remote_write_drops", "remote_reads", "remote_read_bytes", "remote_hits", "remote_misses", "remote_fetch_drops", "remote_verify_failures", "remote_errors", "remote_inflight_bytes", "disk_enabled", "disk_healthy", "disk_down_reason", "disk_direct_io", "disk_capacity_bytes", "disk_used_bytes", "disk_records", "disk_inflight_bytes", "disk_writes", "disk_write_bytes", "disk_reads", "disk_read_bytes", "disk_hits", "disk_misses", "disk_write_drops", "disk_promote_drops", "disk_rejected", "disk_errors", "disk_evicted", "disk_recovery_complete", "disk_recovery_source", "disk_recovery_scanned_bytes", "disk_recovery_total_bytes", "disk_recovered", "disk_write_mode", "disk_write_waiting", "shard", "shard_count", "numa_host_nodes", "numa_policy", "numa_pool_nodes", "numa_basis", "numa_copy_thread_nodes", "numa_copy_thread_cpus", "gpu_copy_devices", "gpu_copy_threads", "gpu_copy_nodes", "copy_threads", "copies_started", "copy_wait_seconds", "copy_busy_seconds", "gpu_copies_started", "gpu_copy_wait_seconds", "gpu_copy_busy_seconds", "copy_longest_running_seconds", "gpu_copy_longest_running_seconds", "loop_cpu_seconds", "touched_keys", "chunk_event_rows", "chunk_event_bytes", "kv_events_published", "kv_events_dropped")
    class EvictionsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DiskWriteDropsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_EXTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STORES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_JOBS_FIELD_NUMBER: _ClassVar[int]
    POOL_BACKING_FIELD_NUMBER: _ClassVar[int]
    WARM_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    STORE_JOBS_FIELD_NUMBER: _ClassVar[int]
    LOAD_JOBS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_STORE_JOBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_LOAD_JOBS_FIELD_NUMBER: _ClassVar[int]
    PIN_CALLS_FIELD_NUMBER: _ClassVar[int]
    PIN_KEYS_FIELD_NUMBER: _ClassVar[int]
    PINNED_KEYS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_BLOCKS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_BLOCKS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    JOB_LANES_OPEN_FIELD_NUMBER: _ClassVar[int]
    LANE_JOBS_FIELD_NUMBER: _ClassVar[int]
    PAGE_LOCKING_FIELD_NUMBER: _ClassVar[int]
    PAGE_LOCKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_LOCKING_ERROR_FIELD_NUMBER: _ClassVar[int]
    POPULATING_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_PINS_FIELD_NUMBER: _ClassVar[int]
    LANE_UNPINS_FIELD_NUMBER: _ClassVar[int]
    PERMISSION_DENIED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITE_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITE_DROPS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MISSES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FETCH_DROPS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DISK_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DISK_DOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    DISK_DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DISK_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_MISSES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_DROPS_FIELD_NUMBER: _ClassVar[int]
    DISK_PROMOTE_DROPS_FIELD_NUMBER: _ClassVar[int]
    DISK_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DISK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_SCANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_RECOVERED_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_MODE_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_WAITING_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUMA_HOST_NODES_FIELD_NUMBER: _ClassVar[int]
    NUMA_POLICY_FIELD_NUMBER: _ClassVar[int]
    NUMA_POOL_NODES_FIELD_NUMBER: _ClassVar[int]
    NUMA_BASIS_FIELD_NUMBER: _ClassVar[int]
    NUMA_COPY_THREAD_NODES_FIELD_NUMBER: _ClassVar[int]
    NUMA_COPY_THREAD_CPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_DEVICES_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_THREADS_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_NODES_FIELD_NUMBER: _ClassVar[int]
    COPY_THREADS_FIELD_NUMBER: _ClassVar[int]
    COPIES_STARTED_FIELD_NUMBER: _ClassVar[int]
    COPY_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_COPIES_STARTED_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_LONGEST_RUNNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_COPY_LONGEST_RUNNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOP_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_EVENT_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_EVENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    version: str
    boot_id: str
    uptime_seconds: float
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    largest_free_extent_bytes: int
    warmup_done_bytes: int
    warmup_complete: bool
    ready_blocks: int
    writing_blocks: int
    pinned_blocks: int
    sessions: int
    registrations: int
    namespaces: int
    lookups: int
    hits: int
    misses: int
    evictions: int
    stores: int
    loads: int
    stored_bytes: int
    loaded_bytes: int
    dropped_stores: int
    inflight_jobs: int
    pool_backing: str
    warm_restarted: bool
    evictions_by_reason: _containers.ScalarMap[str, int]
    store_jobs: int
    load_jobs: int
    stored_blocks: int
    loaded_blocks: int
    failed_store_jobs: int
    failed_load_jobs: int
    pin_calls: int
    pin_keys: int
    pinned_keys: int
    recovery_blocks_total: int
    recovery_blocks_verified: int
    recovery_blocks_rejected: int
    recovery_complete: bool
    job_lanes_open: int
    lane_jobs: int
    page_locking: bool
    page_locked_bytes: int
    page_locking_error: str
    populating_bytes: int
    lane_pins: int
    lane_unpins: int
    permission_denied: int
    remote_enabled: bool
    remote_healthy: bool
    remote_writes: int
    remote_write_bytes: int
    remote_write_present: int
    remote_write_drops: int
    remote_reads: int
    remote_read_bytes: int
    remote_hits: int
    remote_misses: int
    remote_fetch_drops: int
    remote_verify_failures: int
    remote_errors: int
    remote_inflight_bytes: int
    disk_enabled: bool
    disk_healthy: bool
    disk_down_reason: str
    disk_direct_io: bool
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_records: int
    disk_inflight_bytes: int
    disk_writes: int
    disk_write_bytes: int
    disk_reads: int
    disk_read_bytes: int
    disk_hits: int
    disk_misses: int
    disk_write_drops: _containers.ScalarMap[str, int]
    disk_promote_drops: int
    disk_rejected: int
    disk_errors: int
    disk_evicted: int
    disk_recovery_complete: bool
    disk_recovery_source: str
    disk_recovery_scanned_bytes: int
    disk_recovery_total_bytes: int
    disk_recovered: int
    disk_write_mode: str
    disk_write_waiting: int
    shard: int
    shard_count: int
    numa_host_nodes: int
    numa_policy: str
    numa_pool_nodes: _containers.RepeatedScalarFieldContainer[int]
    numa_basis: str
    numa_copy_thread_nodes: _containers.RepeatedScalarFieldContainer[int]
    numa_copy_thread_cpus: _containers.RepeatedScalarFieldContainer[str]
    gpu_copy_devices: _containers.RepeatedScalarFieldContainer[str]
    gpu_copy_threads: int
    gpu_copy_nodes: _containers.RepeatedScalarFieldContainer[int]
    copy_threads: int
    copies_started: int
    copy_wait_seconds: float
    copy_busy_seconds: float
    gpu_copies_started: _containers.RepeatedScalarFieldContainer[int]
    gpu_copy_wait_seconds: _containers.RepeatedScalarFieldContainer[float]
    gpu_copy_busy_seconds: _containers.RepeatedScalarFieldContainer[float]
    copy_longest_running_seconds: float
    gpu_copy_longest_running_seconds: _containers.RepeatedScalarFieldContainer[float]
    loop_cpu_seconds: float
    touched_keys: int
    chunk_event_rows: int
    chunk_event_bytes: int
    kv_events_published: int
    kv_events_dropped: int
    def __init__(self, version: _Optional[str] = ..., boot_id: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., largest_free_extent_bytes: _Optional[int] = ..., warmup_done_bytes: _Optional[int] = ..., warmup_complete: _Optional[bool] = ..., ready_blocks: _Optional[int] = ..., writing_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., sessions: _Optional[int] = ..., registrations: _Optional[int] = ..., namespaces: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stores: _Optional[int] = ..., loads: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., dropped_stores: _Optional[int] = ..., inflight_jobs: _Optional[int] = ..., pool_backing: _Optional[str] = ..., warm_restarted: _Optional[bool] = ..., evictions_by_reason: _Optional[_Mapping[str, int]] = ..., store_jobs: _Optional[int] = ..., load_jobs: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., failed_store_jobs: _Optional[int] = ..., failed_load_jobs: _Optional[int] = ..., pin_calls: _Optional[int] = ..., pin_keys: _Optional[int] = ..., pinned_keys: _Optional[int] = ..., recovery_blocks_total: _Optional[int] = ..., recovery_blocks_verified: _Optional[int] = ..., recovery_blocks_rejected: _Optional[int] = ..., recovery_complete: _Optional[bool] = ..., job_lanes_open: _Optional[int] = ..., lane_jobs: _Optional[int] = ..., page_locking: _Optional[bool] = ..., page_locked_bytes: _Optional[int] = ..., page_locking_error: _Optional[str] = ..., populating_bytes: _Optional[int] = ..., lane_pins: _Optional[int] = ..., lane_unpins: _Optional[int] = ..., permission_denied: _Optional[int] = ..., remote_enabled: _Optional[bool] = ..., remote_healthy: _Optional[bool] = ..., remote_writes: _Optional[int] = ..., remote_write_bytes: _Optional[int] = ..., remote_write_present: _Optional[int] = ..., remote_write_drops: _Optional[int] = ..., remote_reads: _Optional[int] = ..., remote_read_bytes: _Optional[int] = ..., remote_hits: _Optional[int] = ..., remote_misses: _Optional[int] = ..., remote_fetch_drops: _Optional[int] = ..., remote_verify_failures: _Optional[int] = ..., remote_errors: _Optional[int] = ..., remote_inflight_bytes: _Optional[int] = ..., disk_enabled: _Optional[bool] = ..., disk_healthy: _Optional[bool] = ..., disk_down_reason: _Optional[str] = ..., disk_direct_io: _Optional[bool] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_records: _Optional[int] = ..., disk_inflight_bytes: _Optional[int] = ..., disk_writes: _Optional[int] = ..., disk_write_bytes: _Optional[int] = ..., disk_reads: _Optional[int] = ..., disk_read_bytes: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_misses: _Optional[int] = ..., disk_write_drops: _Optional[_Mapping[str, int]] = ..., disk_promote_drops: _Optional[int] = ..., disk_rejected: _Optional[int] = ..., disk_errors: _Optional[int] = ..., disk_evicted: _Optional[int] = ..., disk_recovery_complete: _Optional[bool] = ..., disk_recovery_source: _Optional[str] = ..., disk_recovery_scanned_bytes: _Optional[int] = ..., disk_recovery_total_bytes: _Optional[int] = ..., disk_recovered: _Optional[int] = ..., disk_write_mode: _Optional[str] = ..., disk_write_waiting: _Optional[int] = ..., shard: _Optional[int] = ..., shard_count: _Optional[int] = ..., numa_host_nodes: _Optional[int] = ..., numa_policy: _Optional[str] = ..., numa_pool_nodes: _Optional[_Iterable[int]] = ..., numa_basis: _Optional[str] = ..., numa_copy_thread_nodes: _Optional[_Iterable[int]] = ..., numa_copy_thread_cpus: _Optional[_Iterable[str]] = ..., gpu_copy_devices: _Optional[_Iterable[str]] = ..., gpu_copy_threads: _Optional[int] = ..., gpu_copy_nodes: _Optional[_Iterable[int]] = ..., copy_threads: _Optional[int] = ..., copies_started: _Optional[int] = ..., copy_wait_seconds: _Optional[float] = ..., copy_busy_seconds: _Optional[float] = ..., gpu_copies_started: _Optional[_Iterable[int]] = ..., gpu_copy_wait_seconds: _Optional[_Iterable[float]] = ..., gpu_copy_busy_seconds: _Optional[_Iterable[float]] = ..., copy_longest_running_seconds: _Optional[float] = ..., gpu_copy_longest_running_seconds: _Optional[_Iterable[float]] = ..., loop_cpu_seconds: _Optional[float] = ..., touched_keys: _Optional[int] = ..., chunk_event_rows: _Optional[int] = ..., chunk_event_bytes: _Optional[int] = ..., kv_events_published: _Optional[int] = ..., kv_events_dropped: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("id", "world_size", "blocks_per_chunk", "slot_bytes", "ready_blocks", "writing_blocks", "used_bytes", "description", "group_ids", "share_bytes", "evicted_blocks")
    ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    id: str
    world_size: int
    blocks_per_chunk: int
    slot_bytes: _containers.RepeatedScalarFieldContainer[int]
    ready_blocks: int
    writing_blocks: int
    used_bytes: int
    description: str
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    share_bytes: int
    evicted_blocks: int
    def __init__(self, id: _Optional[str] = ..., world_size: _Optional[int] = ..., blocks_per_chunk: _Optional[int] = ..., slot_bytes: _Optional[_Iterable[int]] = ..., ready_blocks: _Optional[int] = ..., writing_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., description: _Optional[str] = ..., group_ids: _Optional[_Iterable[int]] = ..., share_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegistrationInfo(_message.Message):
    __slots__ = ("registration_id", "namespace_id", "rank", "memory_path", "registered_bytes", "unit_count")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PATH_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    namespace_id: str
    rank: int
    memory_path: str
    registered_bytes: int
    unit_count: int
    def __init__(self, registration_id: _Optional[int] = ..., namespace_id: _Optional[str] = ..., rank: _Optional[int] = ..., memory_path: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., unit_count: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("session_id", "client_name", "pid", "engine_id", "connected_seconds", "registrations", "pinned_blocks", "job_lanes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    JOB_LANES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    client_name: str
    pid: int
    engine_id: str
    connected_seconds: float
    registrations: _containers.RepeatedCompositeFieldContainer[RegistrationInfo]
    pinned_blocks: int
    job_lanes: int
    def __init__(self, session_id: _Optional[str] = ..., client_name: _Optional[str] = ..., pid: _Optional[int] = ..., engine_id: _Optional[str] = ..., connected_seconds: _Optional[float] = ..., registrations: _Optional[_Iterable[_Union[RegistrationInfo, _Mapping]]] = ..., pinned_blocks: _Optional[int] = ..., job_lanes: _Optional[int] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("namespace_id", "has_group", "group", "page_size", "page_token")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    has_group: bool
    group: int
    page_size: int
    page_token: str
    def __init__(self, namespace_id: _Optional[str] = ..., has_group: _Optional[bool] = ..., group: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("namespace_id", "key_hex", "group", "state", "pins", "bytes", "pool_offset", "written_ranks_mask", "key")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_HEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_RANKS_MASK_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    key_hex: str
    group: int
    state: str
    pins: int
    bytes: int
    pool_offset: int
    written_ranks_mask: int
    key: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., key_hex: _Optional[str] = ..., group: _Optional[int] = ..., state: _Optional[str] = ..., pins: _Optional[int] = ..., bytes: _Optional[int] = ..., pool_offset: _Optional[int] = ..., written_ranks_mask: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "total_blocks")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    total_blocks: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted_blocks", "skipped_blocks", "not_found_blocks")
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    evicted_blocks: int
    skipped_blocks: int
    not_found_blocks: int
    def __init__(self, evicted_blocks: _Optional[int] = ..., skipped_blocks: _Optional[int] = ..., not_found_blocks: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("evicted_blocks", "skipped_blocks")
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    evicted_blocks: int
    skipped_blocks: int
    def __init__(self, evicted_blocks: _Optional[int] = ..., skipped_blocks: _Optional[int] = ...) -> None: ...
