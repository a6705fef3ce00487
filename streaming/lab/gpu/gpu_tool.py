"""The GPU benchmark tool: `python streaming/lab/gpu/gpu_tool.py {bench,peers,exact,profile,corpus} --help`.

Each subcommand writes NAME.json and NAME.txt (a table) into its --out folder; README.md beside it
says what each one measures and how to run it on the lent H200."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Scripts run from a checkout, not a package: the subcommands' modules sit next to this file, and
# the checkout's tests/ holds exactness.py (what `exact` compares with).
sys.path[:0] = [str(HERE), str(HERE.parents[2] / "tests")]

import tool_bench  # noqa: E402
import tool_corpus  # noqa: E402
import tool_exact  # noqa: E402
import tool_peers  # noqa: E402
import tool_profile  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_tool.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for module in (tool_bench, tool_peers, tool_exact, tool_profile, tool_corpus):
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
