"""The `kvdepot` command: `serve` runs the daemon, `status` shows it, `bench` measures it.

`kvdepot bench` is a program of its own (kvdepot.bench.cli, also `python -m
kvdepot.bench`): this module hands it the arguments by module name and never imports
it, so the daemon does not depend on the benchmarks (docs/architecture.md §2).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import kvdepot

BENCH_MODULE = "kvdepot.bench.cli"


def main(argv: list[str] | None = None) -> int:
    args_given = sys.argv[1:] if argv is None else argv
    if args_given[:1] == ["bench"]:  # its flags are its own: parsed there
        return run_bench(args_given[1:])
    parser = argparse.ArgumentParser(
        prog="kvdepot", description="Node-local KV-cache offload daemon for vLLM."
    )
    parser.add_argument("--version", action="version", version=f"kvdepot {kvdepot.__version__}")
    from kvdepot.server.config import SettingsParser, add_serve_arguments, config_from_args

    # Subcommands report bad values in one line naming the flag or variable.
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SettingsParser)

    serve_p = sub.add_parser("serve", help="run the daemon")
    add_serve_arguments(serve_p)

    from kvdepot.server.status.command import add_status_arguments, run_status

    add_status_arguments(sub.add_parser("status", help="show the running daemon's state"))

    # Listed for --help; `kvdepot bench ...` never gets here (see above).
    sub.add_parser("bench", help="measure throughput and latency (kvdepot bench --help)")

    args = parser.parse_args(argv)
    if args.command == "serve":
        from kvdepot.server.daemon import serve
        from kvdepot.server.shards import check_shards

        config = config_from_args(args)
        try:  # settings that cannot be split --shards ways: a bad setting like any other
            check_shards(config)
        except ValueError as exc:
            serve_p.error(str(exc))
        return serve(config)
    if args.command == "status":
        return run_status(args)
    return run_bench([])


def run_bench(argv: list[str]) -> int:
    """`kvdepot bench <argv>`: kvdepot.bench.cli's `main`, found by name."""
    try:
        bench = importlib.import_module(BENCH_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvdepot.bench", BENCH_MODULE):
            raise  # the bench is installed but lacks something: show what
        print("kvdepot: kvdepot bench is not available in this installation", file=sys.stderr)
        return 2
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
