"""The `kvdepot` command: `serve` runs the daemon, `status` shows it, `bench` measures it."""

from __future__ import annotations

import argparse
import sys

import kvdepot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvdepot", description="Node-local KV-cache offload daemon for vLLM."
    )
    parser.add_argument("--version", action="version", version=f"kvdepot {kvdepot.__version__}")
    from kvdepot.server.config import SettingsParser, add_serve_arguments, config_from_args

    # Subcommands report bad values in one line naming the flag or variable.
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SettingsParser)

    serve_p = sub.add_parser("serve", help="run the daemon")
    add_serve_arguments(serve_p)

    from kvdepot.server.status import add_status_arguments, run_status

    add_status_arguments(sub.add_parser("status", help="show the running daemon's state"))

    bench_p = sub.add_parser("bench", help="measure throughput and latency")
    try:
        from kvdepot.bench.cli import add_bench_arguments, run_bench
    except ImportError:  # the bench module is optional
        add_bench_arguments = run_bench = None  # type: ignore[assignment]
    if add_bench_arguments is not None:
        add_bench_arguments(bench_p)

    args = parser.parse_args(argv)
    if args.command == "serve":
        from kvdepot.server.daemon import serve

        return serve(config_from_args(args))
    if args.command == "status":
        return run_status(args)
    if run_bench is None:
        parser.error("kvdepot bench is not available in this installation")
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
