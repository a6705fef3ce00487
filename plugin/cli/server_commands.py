"""Server commands: `serve` and `mlx-openai-server` (mlx-openai-server with the plugin),
`mlx-lm-server`, and (from their own modules) `demo`, `plan` and `status`."""

from __future__ import annotations

import argparse

from expert_stream.streaming.errors import ExpertStreamError


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="start mlx-openai-server on a config with expert_stream blocks",
        description="Start mlx-openai-server (multi-model mode) on FILE with expert streaming. Flags after "
                    "FILE go to the host's `launch` (--host, --port and --log-level go into the config's "
                    "`server:` section). Tested with mlx-openai-server 1.6.3 and 1.8.1.")
    p.add_argument("--config", required=True, help="the host's YAML config with expert_stream blocks")
    p.set_defaults(func=run_serve)
    _pass_unknown_flags(p, "flags for mlx-openai-server launch")

    p = sub.add_parser(
        "mlx-openai-server", help="mlx-openai-server's own command line, with the plugin",
        description="`expert-stream mlx-openai-server launch --config FILE ...` is `serve`; any other command "
                    "line runs the host unchanged.")
    p.set_defaults(func=run_openai_passthrough)
    _pass_unknown_flags(p, "mlx-openai-server's command line")

    p = sub.add_parser(
        "mlx-lm-server", help="start mlx_lm.server with models from a YAML file",
        description="Start mlx_lm.server with the models of a small YAML file (models: [{model_path, "
                    "served_model_name, expert_stream: {...}}]); flags after `--` go to mlx_lm.server.")
    p.add_argument("--config", required=True, help="models YAML")
    p.set_defaults(func=run_mlx_lm_server)
    _pass_unknown_flags(p, "mlx_lm.server flags (--host, --port, ...)")

    from expert_stream.plugin.cli import demo_command, plan_command, status_command

    demo_command.register(sub)
    plan_command.register(sub)

    status_command.register(sub)


def _pass_unknown_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """Arguments this parser does not know go to the host (`args.host_args`) instead of being an
    error: argparse's REMAINDER cannot take a leading `--flag`."""
    parse = parser.parse_known_args
    parser.epilog = f"Other arguments: {what}."

    def parse_known_args(args=None, namespace=None):
        namespace, extras = parse(args, namespace)
        namespace.host_args = getattr(namespace, "host_args", None) or []
        namespace.host_args += extras
        return namespace, []

    parser.parse_known_args = parse_known_args


def _host(name: str):
    from expert_stream.plugin import plugins

    hosts = plugins.hosts()
    if name not in hosts:
        raise ExpertStreamError(f"no host adapter named {name!r} is registered (have: {', '.join(sorted(hosts))})")
    return hosts[name]


def _strip_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def run_serve(args) -> int:
    return _host("mlx-openai-server").serve(args.config, _strip_dashes(args.host_args))


def run_openai_passthrough(args) -> int:
    host_args = _strip_dashes(args.host_args)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    known, rest = parser.parse_known_args(host_args)
    host = _host("mlx-openai-server")
    if known.config and (not rest or rest[0] == "launch" or rest[0].startswith("-")):
        return host.serve(known.config, [a for a in rest if a != "launch"])
    return host.run_cli(host_args)


def run_mlx_lm_server(args) -> int:
    return _host("mlx_lm.server").serve(args.config, _strip_dashes(args.host_args))
