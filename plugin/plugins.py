"""The plugin manager: built-in plugins first, then the `expert_stream` entry-point group.

Environment:
- EXPERT_STREAM_PLUGINS: comma-separated entry-point names to load; nothing else from the
  entry-point group is loaded ("" loads none). Unset: all installed plugins load.
- EXPERT_STREAM_BLOCK_PLUGINS: comma-separated plugin names (entry-point or built-in, such as
  `expert_stream.plugin.default_plugins.moe_detection`) that are never registered.
"""

from __future__ import annotations

import importlib
import os
import threading

import pluggy

from . import hookspecs

PROJECT = "expert_stream"
DEFAULT_PLUGINS = (
    "expert_stream.plugin.default_plugins.architectures",
    "expert_stream.plugin.default_plugins.moe_detection",
    "expert_stream.plugin.default_plugins.hosts",
)

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


def _names(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def make_plugin_manager(entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the built-ins and (unless told not to) the installed plugins."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in _names("EXPERT_STREAM_BLOCK_PLUGINS") or ():
        pm.set_blocked(name)
    for module_name in DEFAULT_PLUGINS:
        if pm.is_blocked(module_name):
            continue
        pm.register(importlib.import_module(module_name), name=module_name)
    if entry_points:
        allowed = _names("EXPERT_STREAM_PLUGINS")
        if allowed is None:
            pm.load_setuptools_entrypoints(PROJECT)
        else:
            for name in sorted(allowed):
                if not pm.is_blocked(name):
                    pm.load_setuptools_entrypoints(PROJECT, name=name)
    pm.check_pending()
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, made on first use."""
    global _pm
    with _lock:
        if _pm is None:
            _pm = make_plugin_manager()
        return _pm


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests; after changing the environment variables)."""
    global _pm
    with _lock:
        _pm = None


def _collect(hook) -> list:
    items: list = []
    hook(register=items.append)
    return items


def architectures(pm: pluggy.PluginManager | None = None) -> list:
    """Every registered ArchitectureSpec. pluggy calls the last registered plugin first, so a
    third-party spec for a model_type wins over the built-in one."""
    pm = pm or get_plugin_manager()
    return _collect(pm.hook.register_architectures)


def hosts(pm: pluggy.PluginManager | None = None) -> dict:
    """Registered host adapters by name; a later plugin's adapter replaces a built-in one."""
    pm = pm or get_plugin_manager()
    found: dict = {}
    for host in reversed(_collect(pm.hook.register_hosts)):
        found[host.name] = host
    return found


def plugin_names(pm: pluggy.PluginManager | None = None) -> list[str]:
    pm = pm or get_plugin_manager()
    return sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None)


def load_hooks(pm: pluggy.PluginManager | None = None):
    """What the plugins add to the engine's load checks (streaming/load_checks.LoadHooks): the
    registered architectures and the detect_moe and validate_settings hooks."""
    from expert_stream.streaming.load_checks import LoadHooks

    pm = pm or get_plugin_manager()

    def validate_settings(settings, model_path, where):
        pm.hook.validate_settings(settings=settings, model_path=model_path, where=where)

    return LoadHooks(architectures(pm), lambda index: bool(pm.hook.detect_moe(index=index)), validate_settings)
