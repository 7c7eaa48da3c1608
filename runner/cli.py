"""The `wan-enhanced` command line. Each command lives in its own module."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import (bench_command, demo_command, golden_command, lora_command, report_command,
               run_command)
from .stop_signals import STOP_SIGNALS, ignored


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


def entry() -> None:
    """The `wan-enhanced` program: main() as a process. A command takes Ctrl-C, `kill` and a
    hangup while it works; one that arrives after that, while the process shuts down (its
    models freed, its threads ended), ends the process at once with the command's exit code,
    never with a traceback or the shell's 130 / 143; one that arrives while a command that
    took none unwinds exits 1, as an interrupted run does."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = run_command.FAILED  # the code of a run stopped by Ctrl-C or `kill`
    end_on_signal(code)
    sys.exit(code)


def end_on_signal(code: int) -> None:
    """From now on a stop signal (not one ignored at the start) ends the process with `code`."""
    def end(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream must not keep the process alive
                pass
        os._exit(code)

    for signum in STOP_SIGNALS:
        if not ignored(signum):
            signal.signal(signum, end)


if __name__ == "__main__":
    entry()
