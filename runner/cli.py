"""The `wan-enhanced` command line. Each command lives in its own module."""

from __future__ import annotations

import argparse
import sys

from . import (bench_command, demo_command, golden_command, lora_command, report_command,
               run_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wan-enhanced",
                                     description="Wan2.1 / Wan2.2 video generation tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    golden_command.add_parser(commands)
    run_command.add_parser(commands)
    demo_command.add_parser(commands)
    report_command.add_parser(commands)
    bench_command.add_parser(commands)
    lora_command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
