"""Every registered host is a HostAdapter (the protocol `register_hosts` promises), checked with
the real adapters and the installed hosts; the start-up check names the missing internal and the
host version (an internal removed from the installed host, the injected fault); and the hosts'
private internals are touched in their compat modules only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from expert_stream.plugin import plugins
from expert_stream.plugin.config import HostSchema
from expert_stream.plugin.hosts.base import HostAdapter, HostError
from plugin_fixtures import needs_openai_server, openai_server_installed

PLUGIN = Path(__file__).resolve().parents[2] / "plugin"


def test_every_registered_host_satisfies_the_protocol():
    hosts = plugins.hosts(plugins.make_plugin_manager(entry_points=False))
    assert set(hosts) == {"mlx-openai-server", "mlx_lm.server"}
    for name, host in hosts.items():
        assert isinstance(host, HostAdapter), name
        assert host.name == name
        if name == "mlx-openai-server" and not openai_server_installed():
            with pytest.raises(HostError, match="mlx-openai-server is not installed"):
                host.schema()
            continue
        internals = host.internals()
        schema = host.schema(internals)
        assert isinstance(schema, HostSchema) and schema.name == name
        assert schema.version == internals.version == host.version()
        assert "model_path" in schema.entry_keys


def test_an_object_missing_a_member_is_not_a_host_adapter():
    class NoServe:
        name = distribution = install_hint = "x"

        def version(self): ...

        def internals(self): ...

        def schema(self, internals=None): ...

        def load_config(self, path, internals=None, **kw): ...

    assert not isinstance(NoServe(), HostAdapter)
    NoServe.serve = lambda self, config_path, host_args: 0
    assert isinstance(NoServe(), HostAdapter)


def test_mlx_lm_server_start_up_check_names_the_missing_internal_and_version(monkeypatch, tmp_path):
    import mlx_lm.server

    from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER

    monkeypatch.delattr(mlx_lm.server.ModelProvider, "_load")
    monkeypatch.delattr(mlx_lm.server.ResponseGenerator, "generate")
    version = MLX_LM_SERVER.version()
    with pytest.raises(HostError) as refused:
        MLX_LM_SERVER.internals()
    message = str(refused.value)
    assert f"mlx_lm.server (mlx-lm) {version} is not supported" in message
    assert "ModelProvider._load is missing" in message and "ResponseGenerator.generate is missing" in message
    with pytest.raises(HostError, match="ModelProvider._load is missing"):  # before anything starts
        MLX_LM_SERVER.serve(str(tmp_path / "never-read.yaml"), [])


def test_mlx_openai_server_start_up_check_names_the_missing_internal_and_version(monkeypatch, tmp_path):
    needs_openai_server()
    from app.core import handler_process

    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    monkeypatch.delattr(handler_process.HandlerProcessProxy, "_call")
    version = MLX_OPENAI_SERVER.version()
    with pytest.raises(HostError) as refused:
        MLX_OPENAI_SERVER.internals()
    message = str(refused.value)
    assert f"mlx-openai-server {version} is not supported" in message
    assert "HandlerProcessProxy._call is missing" in message
    with pytest.raises(HostError, match="HandlerProcessProxy._call is missing"):
        MLX_OPENAI_SERVER.serve(str(tmp_path / "never-read.yaml"), [])


# The hosts' private attributes, and where each may be named.
PRIVATE = {
    "hosts/openai/compat.py": ("_pending", "_process", "_handlers", "_metadata", "_handler_worker",
                               "_raise_remote_error", "_MODEL_TYPE_TO_HANDLER_TYPE", "_call"),
    "hosts/mlx_lm/compat.py": ("_model_map", "_adapter_map", "model_key", "is_batchable", "_load",
                               "_next_request", "load_default", "model_provider"),
}


def test_private_host_internals_are_touched_in_the_compat_modules_only():
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            for home, names in PRIVATE.items():
                own = node.attr == "_load" and ast.unparse(node.value) == "self"  # Reloader's own _load
                if path.relative_to(PLUGIN).as_posix() != home and node.attr in names and not own:
                    found.append(f"{path.relative_to(PLUGIN)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
