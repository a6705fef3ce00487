"""The `expert-stream` command. Each command group lives in its own module with a `register`
function that adds its subcommands; this file only assembles them: the user's commands from
this folder, the lab's (bench, synth, policy-eval) from lab/."""

from __future__ import annotations

import argparse
import importlib
import sys

from expert_stream.streaming.errors import ExpertStreamError

# Modules contributing subcommands, in the order `--help` lists them. The lab's commands (lab/)
# exist for measuring and development; the others are the user's.
COMMAND_MODULES = [
    "expert_stream.plugin.cli.engine_commands",      # generate
    "expert_stream.plugin.cli.lab.synth_command",    # synth
    "expert_stream.plugin.cli.server_commands",      # serve, mlx-lm-server, demo, plan, status
    "expert_stream.plugin.cli.lab.bench_command",    # bench
    "expert_stream.plugin.cli.trace_command",        # trace
    "expert_stream.plugin.cli.lab.policy_command",   # policy-eval
    "expert_stream.plugin.cli.lab.soak_command",     # soak
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expert-stream",
        description="Run MoE models larger than memory: stream routed experts from SSD.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # a command group not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ExpertStreamError as exc:
        print(f"expert-stream {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
