"""``omnibal`` command line: sub-commands of the OmniBal-Megatron tools.

Written by the data-level helper with only ``isf``; the lead extends it with further sub-commands.
"""
from __future__ import annotations

import argparse
import sys

from omnibal_ext.data.cli import add_isf_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnibal", description="OmniBal-Megatron balancing tools")
    sub = parser.add_subparsers(dest="command", required=True)
    add_isf_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
