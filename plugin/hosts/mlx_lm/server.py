"""mlx_lm.server with expert streaming: `expert-stream mlx-lm-server --config models.yaml -- [flags]`.

mlx_lm.server has no config file; the plugin reads a small one of the same shape as the
mlx-openai-server file:

    expert_stream: {watch: true}
    default_model: qwen            # optional; else the first entry
    models:
      - model_path: ~/models/Qwen3-30B-A3B-4bit
        served_model_name: qwen    # the `model` name requests use
        expert_stream: {}          # budget_gib: auto (fits to memory), or a number of GiB

The server runs in this process. Aliases go into ModelProvider's own name map; the load is
intercepted at `mlx_lm.utils.load_model` for streamed folders. A reload changes the name map and
the targets at once and marks the loaded model stale when its entry changed; the model is then
reloaded inside `ModelProvider.load`, the point where mlx_lm.server itself swaps models between
requests, on the generation thread. Streamed models are served one request at a time (the
provider's `is_batchable` is cleared for them).

The rooms of this folder: compat (every host internal and its check), reloader (the applied
config, the provider patch's callbacks, reloads, the operator's figures), routes (the HTTP routes),
request_counts (requests queued and in flight), and for
mlx_lm.server's pipeline mode pipeline_mode (one rank's load), pipeline_reload (reloads every
rank agrees on) and rank_stats (every rank's counters on rank 0)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

from expert_stream.plugin import run_files
from expert_stream.plugin.config import ConfigError, HostConfig, HostSchema, load_host_config
from expert_stream.plugin.hosts.base import installed_version
from expert_stream.plugin.hosts.mlx_lm import compat
from expert_stream.plugin.hosts.mlx_lm.reloader import LmServerState

log = logging.getLogger("expert_stream")

TESTED_VERSIONS = ("0.31.3", "0.32.2")
SHUTDOWN_GRACE_S = 3.0  # after SIGINT, before requests still running are cut off


class MlxLmServerHost:
    name = "mlx_lm.server"
    distribution = "mlx-lm"
    install_hint = "pip install 'mlx-lm>=0.31,<0.33'"

    def version(self) -> str:
        return installed_version(self.distribution, self.install_hint)

    def internals(self) -> SimpleNamespace:
        """Import and check every host internal the adapter touches; refuse a host that differs."""
        return compat.check(self.name + " (mlx-lm)", self.version())

    def schema(self, internals=None) -> HostSchema:
        version = internals.version if internals else self.version()
        return HostSchema(
            name=self.name, version=version,
            entry_keys=frozenset({"model_path", "served_model_name", "model_id", "adapter_path", "trust_remote_code"}),
            id_key="served_model_name", top_level_keys=frozenset({"default_model"}), one_model_at_a_time=True,
            unread_options=frozenset({"drain_timeout_s", "queue_timeout"}),
        )

    def load_config(self, path, internals=None, **kw) -> HostConfig:
        config = load_host_config(path, self.schema(internals), **kw)
        _check_unique_folders(config)
        _check_default_model(config)
        return config

    def serve(self, config_path: str, host_args: list[str]) -> int:
        from expert_stream.plugin.hosts.mlx_lm.pipeline_mode import PipelineMode, refuse_tensor_parallel

        internals = self.internals()
        pipeline = PipelineMode.detect(host_args)  # each rank checks its own layers' shards when it loads
        config = self.load_config(config_path, internals, check_models=pipeline is None)
        state = LmServerState(self, internals, config)
        state.pipeline = pipeline
        if "--host" in host_args[:-1]:
            state.bind_host = host_args[host_args.index("--host") + 1]
        state.install()
        if pipeline is not None:
            pipeline.install(internals, state)
        else:
            refuse_tensor_parallel(internals)
        default = config.top_level.get("default_model") or config.entries[0].model_id
        _check_draft_flag(host_args, config)
        argv = list(host_args)
        if "--model" not in argv:
            argv += ["--model", default]
        sys.argv = ["mlx_lm.server", *argv]
        if config.options.watch:
            threading.Thread(target=state.watch, name="expert-stream-watch", daemon=True).start()
        try:
            signal.signal(signal.SIGHUP, lambda *_: threading.Thread(
                target=state.reload, args=("SIGHUP",), daemon=True).start())
            signal.signal(signal.SIGINT, _stop_on_interrupt)
        except (ValueError, AttributeError):
            pass
        if pipeline is None or pipeline.rank == 0:  # only rank 0 serves HTTP
            run_files.write(run_files.local_url(*_listen_address(argv)), config.path, self.name)
            threading.Thread(target=state.sample, name="expert-stream-sample", daemon=True).start()
        log.info("expert-stream: serving %s through mlx_lm.server (mlx-lm %s)", config.path, internals.version)
        internals.server.main()
        return 0


def _stop_on_interrupt(signum, frame):
    """Ctrl-C: mlx_lm.server stops its HTTP loop, then joins its generation thread, which
    finishes the request in flight first (minutes for a long one). Give it a few seconds, then
    end the process: open connections are cut, so their clients get an error, not a hang."""
    def exit_later():
        time.sleep(SHUTDOWN_GRACE_S)
        log.warning("expert-stream: mlx_lm.server did not stop within %.0f s of SIGINT; cutting off "
                    "the requests in flight", SHUTDOWN_GRACE_S)
        run_files.remove_own()
        os._exit(130)

    threading.Thread(target=exit_later, name="expert-stream-stop", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
    raise KeyboardInterrupt


def _listen_address(argv: list[str]) -> tuple[str, int]:
    """mlx_lm.server's --host and --port (its defaults: 127.0.0.1, 8080)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    known, _ = parser.parse_known_args(argv)
    return known.host, known.port


def _check_draft_flag(host_args: list[str], config: HostConfig) -> None:
    """mlx_lm.server's --draft-model must not name a streamed entry's folder (reloader.py says why)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--draft-model", default=None)
    draft = parser.parse_known_args(host_args)[0].draft_model
    if draft is None:
        return
    folder = Path(draft).expanduser().resolve()
    for entry in config.entries:
        if entry.streamed and entry.resolved_path() == folder:
            raise ConfigError(f"--draft-model {draft} is the folder of models[{entry.index}] ({entry.model_id}), "
                              "which streams: a draft model loads whole, without streaming; use a small dense "
                              "model with the same tokenizer")


def _check_unique_folders(config: HostConfig) -> None:
    seen: dict = {}
    for entry in config.entries:
        if not entry.streamed:
            continue
        key = str(entry.resolved_path())
        if key in seen:
            raise ConfigError(f"{config.path}: models[{entry.index}] ({entry.model_id}) streams the same folder as "
                              f"{seen[key]}; mlx_lm.server keys models by folder, keep one entry per folder")
        seen[key] = entry.model_id


def _check_default_model(config: HostConfig) -> None:
    """At start and at every reload (the soak found a reload taking a default_model nobody serves)."""
    default = config.top_level.get("default_model")
    if default is not None and default not in config.by_id():
        raise ConfigError(f"{config.path}: default_model {default!r} is not the served_model_name of any entry")


MLX_LM_SERVER = MlxLmServerHost()
