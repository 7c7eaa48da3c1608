"""`wan-enhanced golden FILE...`: check our components against reference files."""

from __future__ import annotations

import time

from ..conformance.check import check_file
from ..conformance.golden_file import GoldenFileError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "golden", help="run the component a reference file describes and compare every output",
        description="Reads files of the wan-golden/1 schema, runs the component each one "
                    "describes on the CPU in float32, prints the max absolute and max relative "
                    "error of every output, and exits non-zero when a tolerance is exceeded.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=run)


def run(args) -> int:
    failed = 0
    for path in args.files:
        start = time.perf_counter()
        try:
            report = check_file(path)
        except GoldenFileError as exc:
            print(f"ERROR {exc}")
            failed += 1
            continue
        print(f"{path} ({report.kind}, {time.perf_counter() - start:.1f} s)")
        for s in report.scores:
            print("  " + s.line())
        if not report.passed:
            failed += 1
    total = len(args.files)
    print(f"{total - failed}/{total} files passed")
    return 1 if failed else 0
