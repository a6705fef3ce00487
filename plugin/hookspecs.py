"""Hook specifications: what a plugin can register. Markers and signatures only."""

import pluggy

hookspec = pluggy.HookspecMarker("expert_stream")
hookimpl = pluggy.HookimplMarker("expert_stream")


@hookspec
def register_architectures(register):
    """Register ArchitectureSpec objects: how a model_type's expert blocks and routers look."""
