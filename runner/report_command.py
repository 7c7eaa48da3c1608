"""`wan-enhanced report EVENTS.json [--out DIR]`: a Markdown memory report with PNG plots."""

from __future__ import annotations

import sys

OK, FAILED, INVALID = 0, 1, 2


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="write a Markdown memory report with plots from a memory event log",
        description="Reads a memory event log (schema wan-enhanced-memory-events/1: the Wan "
                    "Memory Probe's save_log, `wan-enhanced demo` or `wan-enhanced bench` write "
                    "one) and writes NAME-report.md with PNG plots beside it: what each loaded "
                    "component occupies, peak memory per stage, per-step statistics, the memory "
                    "timeline and, when the log has one, the GPU activity trace. Exit codes: 0 "
                    "written, 1 the report could not be written, 2 the events file is missing "
                    "or not an event log.")
    p.add_argument("events", metavar="EVENTS.json")
    p.add_argument("--out", metavar="DIR", help="folder for the report (default: the events "
                                                 "file's folder)")
    p.set_defaults(func=run)


def run(args) -> int:
    # Imported here: the report pulls in matplotlib, which no other command needs.
    from ..profiling.report import ReportError, build_report

    try:
        path = build_report(args.events, args.out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return INVALID
    except OSError as exc:  # the output folder cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    print(path)
    return OK
