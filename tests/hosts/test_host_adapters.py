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
    assert "ModelProvider._load is missing" in message and "ResponseGenerator.generate(request, generation_args) is missing" in message
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


COMPAT = ("hosts/openai/compat.py", "hosts/mlx_lm/compat.py")


def _host_module(name: str) -> bool:
    return name == "app" or name.startswith("app.") or name == "mlx_lm.server" or name.startswith("mlx_lm.server.")


def test_hosts_are_imported_and_patched_in_the_compat_modules_only():
    """Outside a wing's compat module nothing imports the host's packages (mlx-openai-server's
    `app`, `mlx_lm.server`), assigns to what the start-up check returned (`internals.X`, or a
    name bound to it: a patched host class), or sets the host's lifespan conventions on its app
    (`app.state.registry`, `app.state.handler`)."""
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        where = path.relative_to(PLUGIN).as_posix()
        if where in COMPAT:
            continue
        tree = ast.parse(path.read_text())
        from_internals = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                          and isinstance(node.value, ast.Attribute) and "internals" in ast.unparse(node.value)
                          for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                hosts = [a.name for a in node.names if _host_module(a.name)]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                hosts = [module] if _host_module(module) else \
                    [f"{module}.{a.name}" for a in node.names if _host_module(f"{module}.{a.name}")]
            else:
                hosts = []
            found += [f"{where}:{node.lineno}: imports {h}" for h in hosts]
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for attribute in (t for t in targets if isinstance(t, ast.Attribute)):
                    root = attribute
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    text = ast.unparse(attribute)
                    if "internals" in ast.unparse(attribute.value) or (isinstance(root, ast.Name)
                                                                       and root.id in from_internals) \
                            or text.endswith(("state.registry", "state.handler")):
                        found.append(f"{where}:{node.lineno}: assigns {text}")
    assert not found, found
