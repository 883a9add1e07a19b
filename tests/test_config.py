"""`kvdepot serve` settings: one table gives flags, environment fallbacks, defaults and
help; a bad value on the command line or in the environment is one line naming it, exit
status 2, never a traceback. Each case runs the real `kvdepot serve` command."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from kvdepot.server.config import (
    ServeConfig,
    SettingsParser,
    add_serve_arguments,
    config_from_args,
    settings,
)
from tests.support.daemon import kvdepot_command

# Every flag and variable users and deploy files already name, with its default: renaming
# one or changing a default breaks someone's unit file, so it must be a visible decision.
KNOWN = {
    "--socket": "KVDEPOT_SOCKET",
    "--listen": "KVDEPOT_LISTEN",
    "--pool-size": "KVDEPOT_POOL_SIZE",
    "--pool-file": "KVDEPOT_POOL_FILE",
    "--metrics-port": "KVDEPOT_METRICS_PORT",
    "--log-level": "KVDEPOT_LOG_LEVEL",
    "--socket-mode": "KVDEPOT_SOCKET_MODE",
    "--socket-group": "KVDEPOT_SOCKET_GROUP",
    "--no-destructive-admin": "KVDEPOT_NO_DESTRUCTIVE_ADMIN",
    "--copy-threads": "KVDEPOT_COPY_THREADS",
    "--gpu-copy-threads": "KVDEPOT_GPU_COPY_THREADS",
    "--max-job-keys": "KVDEPOT_MAX_JOB_KEYS",
    "--reservation-timeout": "KVDEPOT_RESERVATION_TIMEOUT",
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
    return {**env, **extra}


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvdepot_command(), "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or _clean_env(),
    )


def _assert_one_line_error(out: subprocess.CompletedProcess[str], names: str) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{out.stderr}"
    assert lines[0].startswith("kvdepot serve: error: "), lines[0]
    assert names in lines[0], lines[0]
    return lines[0]


def test_the_table_keeps_every_flag_variable_and_default() -> None:
    table = {s.flag: s.env for _, s in settings()}
    # New settings are one row in ServeConfig; existing ones keep their names.
    assert {flag: table.get(flag) for flag in KNOWN} == KNOWN
    parser = SettingsParser(prog="kvdepot serve")
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVDEPOT_")}
    try:
        add_serve_arguments(parser)
        parsed = config_from_args(parser.parse_args([]))
    finally:
        os.environ.update(old)
    # The flags' defaults are the dataclass's defaults: one place decides both.
    assert parsed == ServeConfig()
    assert (parsed.pool_size, parsed.socket_mode, parsed.copy_threads) == (1 << 30, 0o660, 2)
    assert (parsed.max_job_keys, parsed.reservation_timeout, parsed.log_level) == (
        4096,
        60.0,
        "info",
    )
    assert parsed.destructive_admin and parsed.listen is None and parsed.metrics_port is None


def test_help_lists_the_topics_in_their_order() -> None:
    """The table is written a topic a module (server/config/); ServeConfig joins them so
    that --help lists the daemon's own settings first, its socket first, and the tiers'
    below the pool last, the fleet's then the disk's."""
    flags = [s.flag for _, s in settings()]
    assert flags[:4] == ["--socket", "--listen", "--pool-size", "--pool-file"]
    tiers = [f for f in flags if f.startswith(("--remote", "--disk"))]
    assert flags[-len(tiers) :] == tiers
    assert tiers[0] == "--remote" and tiers[-4] == "--disk" and len(tiers) == 12


def test_help_names_every_variable_and_its_default() -> None:
    out = _serve("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for flag, env in KNOWN.items():
        assert flag in text and env in text, (flag, env)
    for shown in (
        "KVDEPOT_POOL_SIZE; default 1GiB",
        "KVDEPOT_SOCKET_MODE; default 660",
        "KVDEPOT_COPY_THREADS; default 2",
        "KVDEPOT_MAX_JOB_KEYS; default 4096",
    ):
        assert shown in text, shown


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("KVDEPOT_COPY_THREADS", "abc"),
        ("KVDEPOT_COPY_THREADS", "0"),
        ("KVDEPOT_SOCKET_MODE", "rw-rw----"),
        ("KVDEPOT_SOCKET_MODE", "7777"),
        ("KVDEPOT_POOL_SIZE", "lots"),
        ("KVDEPOT_METRICS_PORT", "http"),
        ("KVDEPOT_MAX_JOB_KEYS", "-4"),
        ("KVDEPOT_RESERVATION_TIMEOUT", "forever"),
        ("KVDEPOT_LOG_LEVEL", "loud"),
        ("KVDEPOT_LISTEN", "50051"),
        ("KVDEPOT_SOCKET_GROUP", "no-such-group-kvdepot"),
        ("KVDEPOT_NO_DESTRUCTIVE_ADMIN", "maybe"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(env: str, value: str) -> None:
    # Even with --help: a bad variable must not be ignored quietly.
    line = _assert_one_line_error(_serve("--help", env=_clean_env(**{env: value})), env)
    assert repr(value) in line or value in line


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--copy-threads", "abc"),
        ("--gpu-copy-threads", "0"),
        ("--socket-mode", "999"),
        ("--pool-size", "lots"),
        ("--metrics-port", "70000"),
        ("--reservation-timeout", "nan"),
        ("--log-level", "loud"),
        ("--listen", "localhost"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(flag: str, value: str) -> None:
    _assert_one_line_error(_serve(flag, value), f"argument {flag}:")


def test_a_bad_variable_fails_even_when_its_flag_is_given() -> None:
    # The variable is read even when the flag is given: a unit file with a typo fails
    # at once instead of on the day someone removes the flag.
    out = _serve("--copy-threads", "2", env=_clean_env(KVDEPOT_COPY_THREADS="two"))
    _assert_one_line_error(out, "KVDEPOT_COPY_THREADS")


def test_variables_reach_the_running_daemon_and_flags_win(daemon_factory) -> None:
    env = {
        "KVDEPOT_SOCKET_MODE": "0600",
        "KVDEPOT_POOL_SIZE": "8MiB",
        "KVDEPOT_LISTEN": "",
        "KVDEPOT_POOL_FILE": "",
    }  # empty counts as unset
    d = daemon_factory(env=env)
    assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o600
    assert "pool 8.0 MiB in memfd" in d.log()
    d2 = daemon_factory("--socket-mode", "640", env=env)
    assert stat.S_IMODE(os.stat(d2.socket_path).st_mode) == 0o640


def test_a_plain_argparse_parser_fails_at_once_on_a_bad_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVDEPOT_SOCKET_MODE", "abc")
    with pytest.raises(SystemExit) as exc:
        add_serve_arguments(argparse.ArgumentParser(prog="x"))
    assert exc.value.code == 2 and "KVDEPOT_SOCKET_MODE" in capsys.readouterr().err


def test_every_example_in_the_env_file_is_a_valid_value() -> None:
    # deploy/systemd/kvdepot.env shows one example per variable; each must be accepted.
    env_file = Path(__file__).resolve().parents[1] / "deploy" / "systemd" / "kvdepot.env"
    examples = dict(re.findall(r"^#(KVDEPOT_[A-Z_]+)=(\S+)$", env_file.read_text(), re.M))
    by_env = {s.env: s for _, s in settings()}
    assert examples and set(examples) <= set(by_env)  # test_deploy checks completeness
    for env, value in examples.items():
        if env in ("KVDEPOT_SOCKET_GROUP", "KVDEPOT_ADMIN_GROUP"):
            continue  # a group of the target host, not necessarily of this one
        by_env[env].from_env(value)  # raises ValueError naming what is wrong
