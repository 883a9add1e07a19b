"""The LoadStoreSpecs the scheduler hands to workers (inside vLLM's connector
metadata, pickled): which namespace and which keys, in job order."""

from __future__ import annotations

from vllm.v1.kv_offload.base import LoadStoreSpec


class KVDepotLoadStoreSpec(LoadStoreSpec):
    """Keys of one transfer job, group-major and chunks ascending (vLLM's order),
    and the namespace they live in (it changes after `reset_cache()`)."""

    __slots__ = ("keys", "namespace_id")

    def __init__(self, namespace_id: str, keys: list[bytes]) -> None:
        self.namespace_id = namespace_id
        self.keys = keys

    def __getstate__(self) -> tuple[str, list[bytes]]:
        return self.namespace_id, self.keys

    def __setstate__(self, state: tuple[str, list[bytes]]) -> None:
        self.namespace_id, self.keys = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.namespace_id}, {len(self.keys)} keys)"


class KVDepotStoreSpec(KVDepotLoadStoreSpec):
    """Destination of a store: the daemon allocates the slots when the copy arrives.
    `key_events`: each key's chunk event (kvdepot.v1.ChunkEvent, b"": none), or empty;
    the connector fills it at the step's end (kvdepot.client.vllm.chunk_events)."""

    __slots__ = ("key_events",)

    def __init__(self, namespace_id: str, keys: list[bytes]) -> None:
        super().__init__(namespace_id, keys)
        self.key_events: list[bytes] = []

    # The pickled state gains the key events (the base's is two fields, this one's three).
    def __getstate__(self) -> tuple[str, list[bytes], list[bytes]]:  # type: ignore[override]
        return self.namespace_id, self.keys, self.key_events

    # The base takes a state of two fields: this one's has three.
    def __setstate__(self, state: tuple[str, list[bytes], list[bytes]]) -> None:  # type: ignore[override]
        self.namespace_id, self.keys, self.key_events = state


class KVDepotLoadSpec(KVDepotLoadStoreSpec):
    """Source of a load: keys the scheduler pinned (or tried to) for this request."""
