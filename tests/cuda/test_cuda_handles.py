"""CUDA IPC handles: device UUID forms, the wire message, bad and unwrapped handles."""

from __future__ import annotations

from typing import Any

import pytest

from kvdepot.client.cuda_ipc import encode_handle
from kvdepot.common.cuda_handles import (
    HandleError,
    UnexportableMemory,
    decode,
    expandable_segments_enabled,
    format_uuid,
    parse_uuid,
    raw_handle_from_torch,
    unexportable_message,
    validate,
)
from kvdepot.v1 import depot_pb2 as pb
from tests.support.fake_cuda import EVENT, HANDLE, UUID0

# -- handles -------------------------------------------------------------------------


def test_uuid_forms_parse_to_the_same_bytes_and_format_canonically() -> None:
    raw = parse_uuid(UUID0)
    assert len(raw) == 16
    for text in (
        UUID0.upper(),
        UUID0[4:],
        UUID0.replace("-", "").replace("GPU", "GPU-"),
        "  " + UUID0 + " ",
        "MIG-" + UUID0[4:],
    ):
        assert parse_uuid(text) == raw, text
    assert format_uuid(raw) == UUID0
    with pytest.raises(HandleError, match="never a device index"):
        parse_uuid("0")
    with pytest.raises(HandleError, match="not a device UUID"):
        parse_uuid("GPU-8f5e2a1c-0b3d-4e6f-9a7b")
    with pytest.raises(HandleError, match="16 bytes"):
        format_uuid(b"\x00" * 15)


def test_a_valid_handle_round_trips_through_the_wire_message() -> None:
    spec = validate(HANDLE, UUID0, 4096, 1 << 30, EVENT)
    msg = encode_handle(spec)
    assert isinstance(msg, pb.CudaIpcHandle)
    wire = pb.CudaIpcHandle.FromString(msg.SerializeToString())
    back = decode(wire)
    assert back == spec
    assert back.device == UUID0 and back.end == 4096 + (1 << 30)
    no_event = decode(pb.CudaIpcHandle(ipc_handle=HANDLE, device_uuid=UUID0, size=8))
    assert no_event.event_handle is None and no_event.offset == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mem_handle": HANDLE[:63]}, "has 63 bytes; a cudaIpcMemHandle_t has 64"),
        ({"mem_handle": b"\x01c" + HANDLE}, "_share_cuda_"),
        ({"mem_handle": b"\x00" * 64}, "all zeros"),
        ({"device_uuid": ""}, "device_uuid is empty"),
        ({"device_uuid": "1"}, "never a device index"),
        ({"size": 0}, "size is 0"),
        ({"offset": (1 << 64) - 8, "size": 16}, "overflows 64 bits"),
        ({"offset": 1 << 48, "size": 1}, "beyond any GPU allocation"),
        ({"offset": -1}, "unsigned 64-bit"),
        ({"event_handle": EVENT[:10]}, "event_handle has 10 bytes"),
    ],
)
def test_bad_handles_are_refused_with_what_to_send(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "mem_handle": HANDLE,
        "device_uuid": UUID0,
        "offset": 0,
        "size": 4096,
        "event_handle": b"",
    }
    args.update(kwargs)
    with pytest.raises(HandleError, match=message):
        validate(**args)


def test_torch_share_cuda_handles_are_unwrapped_or_refused() -> None:
    assert raw_handle_from_torch(HANDLE) == HANDLE
    assert raw_handle_from_torch(b"\x01c" + HANDLE) == HANDLE
    with pytest.raises(UnexportableMemory, match="expandable_segments"):
        raw_handle_from_torch(b"\x01e" + b"\x00" * 80)
    with pytest.raises(HandleError, match="unknown PyTorch shareable handle"):
        raw_handle_from_torch(b"\x01x" + HANDLE)


def test_unexportable_memory_names_the_setting_to_change() -> None:
    assert expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments_enabled(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:true"}
    )
    assert not expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_enabled({})
    msg = unexportable_message({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, where="cuda:0")
    assert "PYTORCH_ALLOC_CONF" in msg and "expandable_segments:False" in msg and "cuda:0" in msg
    vmm = unexportable_message({})
    assert "sleep mode" in vmm and "enable_sleep_mode" in vmm and "cuMemCreate" in vmm
