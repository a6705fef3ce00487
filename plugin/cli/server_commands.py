"""Server commands: `serve` and `mlx-openai-server` (mlx-openai-server with the plugin),
`mlx-lm-server`, `demo`, `plan` and `status`."""

from __future__ import annotations

import argparse
import json
import sys

from expert_stream.plugin.cli.server_client import fetch_json, server_url
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

    from expert_stream.plugin.cli import demo_command, plan_command

    demo_command.register(sub)
    plan_command.register(sub)

    p = sub.add_parser("status", help="ask a running server (started through expert-stream) for its status")
    p.add_argument("--url", default=None, help="the server's base URL (default: the running server started "
                   "through expert-stream, from its run file)")
    p.add_argument("--config", default=None, help="the config the server was started with (picks that server)")
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.add_argument("--reload", action="store_true", help="ask it to reload its config first")
    p.set_defaults(func=run_status)


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


def model_line(model_id: str, model: dict) -> str:
    """One model of the status, as `status` prints it."""
    line = f"  {model_id}: {model['state']}"
    if model["streamed"]:
        budget = model.get("budget") or {}
        gib = budget.get("budget_gib", model["settings"]["budget_gib"])
        line += ", streamed, budget auto" if gib == "auto" else \
            f", streamed, budget {gib} GiB" + (" (auto)" if budget.get("auto") else "")
        stats = model.get("stats") or {}
        totals = stats.get("totals")
        layers = stats.get("streamed_layers", 0) + stats.get("resident_layers", 0)
        # A layer whose slots hold all its experts never looks anything up: no hits, no misses.
        held = stats.get("resident_layers", 0) + sum(
            1 for layer in (stats.get("layers") or {}).values()
            if not layer.get("hits") and not layer.get("misses") and layer.get("resident_calls"))
        if totals and not totals["hits"] and not totals["misses"] and held:
            line += f", every expert resident ({layers} MoE layers, nothing read)"
        elif totals:
            line += (f", hit rate {totals['hit_rate']:.1%}, {totals['misses']} misses, "
                     f"{totals['bytes_read'] / 1e9:.3f} GB read")
            if held:
                line += f", {held} of {layers} MoE layers hold every expert"
    else:
        line += ", stock"
    if model.get("error"):
        line += f" ({model['error']})"
    return line


def run_status(args) -> int:
    base = server_url(args.url, args.config)
    if args.reload:
        result = fetch_json(base + "/expert-stream/reload", method="POST", timeout=3600)
        print("reload:", "ok" if result.get("ok") else f"refused: {result.get('error')}")
    status = fetch_json(base + "/expert-stream/status")
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        print()
        return 0
    print(f"config:   {status['config_path']} ({status['host']} {status['host_version']})")
    print(f"applied:  {(status.get('applied_hash') or '-')[:12]}  reloads: {status['reloads']}"
          + ("  (reloading now)" if status.get("reloading") else ""))
    if status.get("last_error"):
        print(f"error:    {status['last_error']}")
    for model_id, model in status["models"].items():
        print(model_line(model_id, model))
    if status.get("pipeline"):
        print(rank_lines(status["pipeline"]))
    return 0


def rank_lines(pipeline: dict) -> str:
    """Every rank's counters (gathered through mlx.distributed between two requests)."""
    age = pipeline.get("age_seconds")
    lines = [f"pipeline: {pipeline['ranks']} ranks, {pipeline.get('model') or 'no model loaded'}"
             + (f", counters as of {age} s ago" if age is not None else ", no counters yet")]
    for r in pipeline.get("per_rank", []):
        if not r["loaded"]:
            lines.append(f"  rank {r['rank']}: not loaded")
            continue
        lines.append(f"  rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, {r['streamed_layers']} "
                     f"streamed, {r['slot_bytes'] / 2**30:.4f} GiB of slots, hit rate {r['hit_rate']:.1%}, "
                     f"{r['misses']} misses, {r['bytes_read'] / 1e9:.3f} GB read")
    return "\n".join(lines)
