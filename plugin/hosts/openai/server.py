"""mlx-openai-server with expert streaming: `expert-stream serve --config FILE [host flags]`.

How it works (multi-model mode, the host's `--config`):
- The plugin reads FILE itself, validates all of it (config.py), and hands the host a copy with
  its `expert_stream:` blocks removed (the bare host crashes on an unknown per-model key), long
  queue timeouts and one request at a time for streamed entries, and the server flags given on
  the command line (--host, --port, --log-level, ...) written into `server:`.
- The host spawns one child process per model. The plugin replaces the host's lifespan with one
  that spawns the same children through the host's own HandlerProcessProxy, so the first load and
  every hot reload take one path, and replaces the child's entry function with
  `child.child_worker`: the entry's settings travel in the queue_config dict the proxy
  already sends to the child, and the child intercepts `mlx_lm.utils.load_model` for that one
  folder (interception.py). Dense and draft models load as they always do.
- Every host internal used is checked before anything starts (`internals`); a host version whose
  internals differ is refused with a message naming the version.
- Routes added to the host's app: GET /expert-stream/status, POST /expert-stream/reload (both
  answer loopback clients only). SIGHUP and file changes (when `watch: true`) reload too.

The rooms of this folder: compat (every host internal and its check), schema and schema_check
(the config schema and server flags), routes (lifespan and control routes), reloader (reload
plans executed on model processes, draining), supervision (model processes that die),
request_queue (requests for a model that is loading), child (the model process's entry).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from expert_stream.plugin import run_files
from expert_stream.plugin.config import HostConfig, HostSchema, load_host_config
from expert_stream.plugin.hosts.base import installed_version
from expert_stream.plugin.hosts.openai import compat
from expert_stream.plugin.hosts.openai.child import child_worker
from expert_stream.plugin.hosts.openai.routes import lifespan_factory
from expert_stream.plugin.hosts.openai.reloader import ServingState
from expert_stream.plugin.hosts.openai.schema import apply_server_flags, host_schema, split_server_flags

log = logging.getLogger("expert_stream")

TESTED_VERSIONS = ("1.6.3", "1.8.1")


class OpenAIServerHost:
    name = "mlx-openai-server"
    distribution = "mlx-openai-server"
    install_hint = "pip install mlx-openai-server==1.6.3 (the newest that installs on Linux; 1.8.x on macOS)"

    def version(self) -> str:
        return installed_version(self.distribution, self.install_hint)

    def internals(self) -> SimpleNamespace:
        """Import and check every host internal the adapter touches; refuse a host that differs."""
        return compat.check(self.name, self.version())

    def schema(self, internals: Optional[SimpleNamespace] = None) -> HostSchema:
        return host_schema(self.name, internals or self.internals())

    def load_config(self, path, internals=None, **kw) -> HostConfig:
        return load_host_config(path, self.schema(internals), **kw)

    def run_cli(self, host_args: list[str]) -> int:
        """The host's own command line, unchanged (`expert-stream mlx-openai-server` without a
        config to serve)."""
        self.version()
        compat.run_host_cli(host_args)
        return 0

    def serve(self, config_path: str, host_args: list[str]) -> int:
        """Start the host on config_path with the plugin; returns the host's exit code."""
        internals = self.internals()
        schema = self.schema(internals)
        server_flags, rest = split_server_flags(host_args)
        config = load_host_config(config_path, schema)
        apply_server_flags(config, server_flags)
        state = ServingState(self, internals, schema, config, server_flags)
        workdir = Path(tempfile.mkdtemp(prefix="expert-stream-"))
        host_file = workdir / "host-config.yaml"
        host_file.write_text(config.host_yaml())
        compat.install(internals, lifespan_factory(state), child_worker)
        server = config.top_level.get("server") or {}
        run_files.write(run_files.local_url(server.get("host", "0.0.0.0"), int(server.get("port", 8000))),
                        config.path, self.name)
        log.info("expert-stream: serving %s through %s %s", config.path, self.name, internals.version)
        try:
            internals.cli.cli.main(args=["launch", "--config", str(host_file), *rest],
                                   prog_name="expert-stream serve", standalone_mode=False)
        except SystemExit as exc:
            return int(exc.code or 0)
        except Exception as exc:  # click errors: show them as the host would
            import click

            if isinstance(exc, click.exceptions.Abort):  # Ctrl-C / SIGINT while serving
                return 130
            if isinstance(exc, click.ClickException):
                exc.show()
                return exc.exit_code
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return 0


MLX_OPENAI_SERVER = OpenAIServerHost()
