"""The disk forger: a tenant that hides a disk-tier record for another namespace in
its own row's bytes (tests/security/test_disk_forgery.py).

    python tests/security/disk_forger.py --target T --namespace NS --victim VNS
        --victim-key HEX --victim-length N --at BYTES

It opens a session of its own, declares its own namespace (an inline layout of one
rank, one group of two 16 KiB layers: a 64 KiB row) and Puts two rows:

- the carrier: zeros, except, at payload offset `--at`, a page that decodes as a
  disk-tier record header for (VNS, the victim's key, N bytes) in the record format
  kvdepot wrote before records were authenticated (version 1: an unkeyed BLAKE3
  digest and a CRC, both computable by anyone), followed by N forged payload bytes
  (0xEE). When the carrier's record is evicted and a smaller record reuses its
  extent's head, a crash leaves that page in free space for the recovery scan.
  After it, the same forgery in the current record format, authenticated with a key
  of the forger's guessing (the forger knows the code, not the daemon's key).
- a plain row of its own (deterministic bytes), which must come back intact.

Prints one JSON object: the two keys (hex), the put outcomes, and the forged bytes.
Nothing here imports the daemon's disk code for the old format: the header is built
from its published layout (docs/disk-tier.md), as an attacker would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import zlib
from pathlib import Path

import blake3

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb

PAGE = 4096
LAYERS = [16384, 16384]
BLOCKS_PER_CHUNK = 2
ROW = BLOCKS_PER_CHUNK * sum(LAYERS)  # 64 KiB: one rank, one group
FORGED_BYTE = 0xEE


def layout(namespace: str) -> pb.NamespaceLayout:
    return pb.NamespaceLayout(
        id=namespace,
        world_size=1,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        groups=[pb.GroupLayout(layer_page_bytes=LAYERS)],
    )


def key(name: bytes) -> bytes:
    """A vLLM-style key of group 0."""
    return hashlib.sha256(name).digest() + (0).to_bytes(4, "big")


def plain_row(k: bytes) -> bytes:
    seed = hashlib.sha256(b"forger's own row" + k).digest()
    return (seed * (ROW // len(seed) + 1))[:ROW]


def v1_header(namespace: str, k: bytes, payload: bytes) -> bytes:
    """A version-1 record header page, exactly as kvdepot's record.py of before wrote
    it: magic, version 1, lengths, an unkeyed BLAKE3 digest over the framed names and
    the payload, the names, a CRC-32 of the header."""
    ns = namespace.encode()
    h = blake3.blake3(struct.pack("<HHQ", len(ns), len(k), len(payload)))
    h.update(ns)
    h.update(k)
    h.update(payload)
    lengths = (len(ns), len(k), len(payload))
    fixed = struct.pack("<8sHHHQ16s", b"KVDDISK\x00", 1, *lengths, h.digest(16))
    body = fixed + ns + k
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(PAGE, b"\0")


def current_header(namespace: str, k: bytes, payload: bytes, offset: int) -> bytes | None:
    """The forgery in the daemon's current format, authenticated with a guessed key
    (all zeros) for the file offset the page will land at; None where the format has
    no such key (the code before records were authenticated)."""
    from kvdepot.server.disk import record

    if not hasattr(record, "RecordKey"):
        return None
    guess = record.RecordKey(bytes(32))
    tag = guess.payload_tag(namespace, k, offset, payload)
    page = memoryview(bytearray(PAGE))
    record.encode_header(record.Header(namespace, k, len(payload), tag), page, offset, guess)
    return bytes(page)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--target", "--namespace", "--victim", "--victim-key"):
        p.add_argument(name, required=True)
    p.add_argument("--victim-length", type=int, required=True)
    p.add_argument("--at", type=int, required=True, help="the forgery's payload offset")
    p.add_argument("--carrier-offset", type=int, default=0, help="where the carrier lands")
    args = p.parse_args()
    victim_key = bytes.fromhex(args.victim_key)
    forged = bytes([FORGED_BYTE]) * args.victim_length
    row = bytearray(ROW)
    first = args.at
    row[first : first + PAGE] = v1_header(args.victim, victim_key, forged)
    row[first + PAGE : first + PAGE + len(forged)] = forged
    # The second forgery right after the first one's record (where an old scan that
    # adopted the first would jump to), in the current format.
    second = first + PAGE + len(forged)
    at_file = args.carrier_offset + PAGE + second
    page = current_header(args.victim, victim_key, forged, at_file)
    if page is not None and second + PAGE + len(forged) <= ROW:
        row[second : second + PAGE] = page
        row[second + PAGE : second + PAGE + len(forged)] = forged
    assert len(row) == ROW

    client = DepotClient(args.target, client_name="disk-forger").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    client.register_kv(layout(args.namespace), 0, None, [], [])
    carrier, own = key(b"carrier"), key(b"own")
    out = {
        "carrier": carrier.hex(),
        "own": own.hex(),
        "current_format_forgery": page is not None,
        "put_carrier": client.put(args.namespace, carrier, 0, bytes(row)).outcome,
        "put_own": client.put(args.namespace, own, 0, plain_row(own)).outcome,
    }
    print(json.dumps(out), flush=True)
    client.close()


if __name__ == "__main__":
    main()
