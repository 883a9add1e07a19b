"""Namespaces cannot be squatted: a known id declared first with another layout
(docs/security.md, "Namespaces that cannot be squatted").

An unsalted namespace id is a digest of the model and layout that anyone with the same
model can compute. Against a real `kvdepot serve`, a squatter process
(tests/security/squatter.py) registers real memory under the victim engine's id first,
with seven layouts other than the victim's; the daemon recomputes the id from the
declaration's digest inputs and refuses each (INVALID_ARGUMENT), while the squatter's
namespace of its own works. Then the victim registers, stores and loads byte for byte,
and a second engine of the same model shares its blocks. (Before, the first declaration
fixed the layout: the victim's RegisterKV got FAILED_PRECONDITION "exists with another
layout", and the connector gave up on the daemon for good.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.security.squatter import VICTIM, attempts
from tests.support.daemon import connect
from tests.support.engine import Engine, make_key
from tests.support.ops import load, store

HERE = Path(__file__).parent
MODEL = "Qwen/Qwen3-8B@9c925d6"  # what the victim's namespace is a digest of


def test_a_known_namespace_id_declared_first_with_another_layout_is_refused(daemon) -> None:
    squatter = subprocess.Popen(
        [sys.executable, str(HERE / "squatter.py"), "--target", daemon.target, "--model", MODEL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None
        got = json.loads(squatter.stdout.readline())
        assert set(got) == set(attempts(MODEL))
        assert got.pop("own_namespace")["code"] == "OK"  # a working client, in its own
        for name, outcome in got.items():
            assert outcome["code"] == "INVALID_ARGUMENT", (name, outcome)
            assert "digest" in outcome["message"], (name, outcome)
        # The squatter still holds its session and its own namespace: the victim engine
        # registers in its namespace, stores, and loads every byte back.
        geo = VICTIM.digested(MODEL)
        engine = connect(daemon.target, "victim-engine")
        victim = Engine(engine, geo, 0)
        store(victim, range(6))
        load(victim, range(6), base_block=32)
        # A second engine of the same model (another session) shares the blocks.
        other = connect(daemon.target, "second-engine")
        load(Engine(other, geo, 0), range(6), base_block=16)
        keys = [make_key(c, 0) for c in range(6)]
        assert other.lookup(geo.namespace, keys) == [True] * 6
        other.close()
        engine.close()
    finally:
        if squatter.stdin is not None:
            squatter.stdin.close()
        assert squatter.wait(timeout=30) == 0
