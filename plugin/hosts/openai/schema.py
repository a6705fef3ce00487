"""What mlx-openai-server accepts in a config file, and the server flags of its command line
that go into the file's `server:` section (multi-model mode ignores them as flags)."""

from __future__ import annotations

import argparse
from typing import Optional

from expert_stream.plugin.config import HostConfig, HostSchema
from expert_stream.plugin.hosts.openai.compat import ONE_AT_A_TIME
from expert_stream.plugin.hosts.openai.schema_check import dataclass_check, section_check

SERVER_FLAGS = {"--host": "host", "--port": "port", "--log-level": "log_level", "--log-file": "log_file"}
# Host entry numbers that become timeouts and queue sizes in the model process.
ENTRY_BOUNDS = {"queue_timeout": (1, 30 * 86400), "queue_size": (1, 1 << 20), "max_concurrency": (1, 1024),
                "context_length": (1, 1 << 32)}


def host_schema(name: str, internals) -> HostSchema:
    """The schema of the checked host (`compat.check`'s result)."""
    return HostSchema(
        name=name,
        version=internals.version,
        entry_keys=frozenset(internals.entry_fields | {"served_model_name", "model_id"}),
        id_key=internals.id_key,
        queue_timeout_key="queue_timeout",
        forced_entry_values={k: v for k, v in ONE_AT_A_TIME.items() if k in internals.entry_fields},
        streamed_entry_check=_lm_only,
        entry_check=dataclass_check(internals.ModelEntryConfig, bounds=ENTRY_BOUNDS),
        top_level_check=section_check("server", internals.ServerConfig, skip=frozenset({"models"}),
                                      bounds={"port": (0, 65535)}) if internals.ServerConfig else None,
        context_key="context_length" if "context_length" in internals.entry_fields else None,
    )


def _lm_only(entry: dict) -> Optional[str]:
    model_type = entry.get("model_type", "lm")
    if model_type != "lm":
        return f"model_type {model_type!r} cannot be streamed (only `lm` models load through mlx-lm)"
    return None


def split_server_flags(args: list[str]) -> tuple[dict, list[str]]:
    """(the `server:` flags given, the rest of the command line for `launch`)."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag, dest in SERVER_FLAGS.items():
        parser.add_argument(flag, dest=dest, default=None, type=int if dest == "port" else str)
    parser.add_argument("--no-log-file", dest="no_log_file", action="store_true", default=None)
    known, rest = parser.parse_known_args(args)
    return {k: v for k, v in vars(known).items() if v is not None}, rest


def apply_server_flags(config: HostConfig, flags: dict) -> None:
    """The command line's server flags win over the file's `server:` section (at every reload)."""
    server = dict(config.top_level.get("server") or {})
    server.update(flags)
    if server:
        config.top_level["server"] = server
