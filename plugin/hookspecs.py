"""Hook specifications: what a plugin can register or observe. Markers and signatures only.

Registration hooks take a `register` callback, so one plugin can register several things and
the core decides how to store them (see plugin/plugins.py)."""

import pluggy

hookspec = pluggy.HookspecMarker("expert_stream")
hookimpl = pluggy.HookimplMarker("expert_stream")


@hookspec
def register_architectures(register):
    """Register ArchitectureSpec objects: how a model_type's expert blocks and routers look."""


@hookspec
def register_hosts(register):
    """Register HostAdapter objects (plugin/hosts/base.py: the protocol they satisfy): servers the
    plugin can start with streaming switched on."""


@hookspec(firstresult=True)
def detect_moe(index):
    """Given a CheckpointIndex, return True (routed experts to stream), False, or None (no opinion)."""


@hookspec
def validate_settings(settings, model_path, where):
    """Check one model entry's StreamSettings; raise SettingsError naming `where` to refuse it."""


@hookspec
def model_loaded(model_id, model_path, handle):
    """A streamed model finished loading (in the process that serves it)."""


@hookspec
def model_unloading(model_id, model_path, handle):
    """A streamed model is about to be unloaded (in the process that serves it)."""


@hookspec
def config_reloaded(path, applied, error):
    """A host config reload finished: `applied` lists (action, model_id); `error` is None or a message."""
