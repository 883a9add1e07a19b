"""Connector settings (`kv_connector_extra_config`): each key's default is written once,
in `DepotSettings`, and every key is documented with that default in both READMEs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvdepot.client.vllm.config import SETTINGS_KEYS, DepotSettings

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_keys_defaults() -> None:
    # An empty extra config and the dataclass's defaults are the same settings.
    assert DepotSettings.from_extra_config({}) == DepotSettings()
    s = DepotSettings()
    assert s.pin_timeout_s == pytest.approx(SETTINGS_KEYS["kvdepot_pin_timeout_ms"] / 1000)
    assert s.remote_wait_s == pytest.approx(0.2)
    assert SETTINGS_KEYS["kvdepot_remote_wait_ms"] == 200


@pytest.mark.parametrize("path", ["auto", "shm", "pvm", "inline", "PVM"])
def test_every_memory_path_is_accepted(path: str) -> None:
    s = DepotSettings.from_extra_config({"kvdepot_memory_path": path})
    assert s.memory_path == path.lower()


def test_remote_wait_is_read_in_milliseconds_and_validated() -> None:
    assert DepotSettings.from_extra_config({"kvdepot_remote_wait_ms": "50"}).remote_wait_s == (
        pytest.approx(0.05)
    )
    assert DepotSettings.from_extra_config({"kvdepot_remote_wait_ms": 0}).remote_wait_s == 0
    for bad in ("soon", -1, float("inf"), None):
        with pytest.raises(ValueError, match="kvdepot_remote_wait_ms"):
            DepotSettings.from_extra_config({"kvdepot_remote_wait_ms": bad})


def test_shards_and_the_first_shard_are_auto_unless_a_number_is_given() -> None:
    s = DepotSettings()
    assert s.shards is None and s.first_shard is None
    auto = DepotSettings.from_extra_config(
        {"kvdepot_shards": " Auto ", "kvdepot_first_shard": "auto"}
    )
    assert auto.shards is None and auto.first_shard is None
    given = DepotSettings.from_extra_config({"kvdepot_shards": "8", "kvdepot_first_shard": 0})
    assert (given.shards, given.first_shard) == (8, 0)
    for key, bad in [
        *[("kvdepot_shards", b) for b in (0, 65, "two", None, 1.5)],
        *[("kvdepot_first_shard", b) for b in (-1, 64, "one", None)],
    ]:
        with pytest.raises(ValueError, match=rf'{key}.*"auto" or a whole number'):
            DepotSettings.from_extra_config({key: bad})


@pytest.mark.parametrize("readme", ["README.md", "client/vllm/README.md"])
def test_every_key_is_documented_with_its_default(readme: str) -> None:
    table = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (REPO / readme).read_text(), re.M)
    rows = {k: v for k, v in table if k.startswith("kvdepot_") or k in SETTINGS_KEYS}
    assert set(rows) == set(SETTINGS_KEYS), readme
    for key, default in SETTINGS_KEYS.items():
        if isinstance(default, float | int) and not isinstance(default, bool):
            assert rows[key].strip() == f"`{default:g}`", (readme, key, rows[key])
