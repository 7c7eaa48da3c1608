"""The `wan-enhanced` command line."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="wan-enhanced")
    parser.add_subparsers(dest="command", required=True)
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
