"""What runs first in each model process mlx-openai-server spawns (multi-model mode).

The parent replaces the host's `_handler_worker` with `child_worker`, so the spawn pickles this
function by name and the child imports this small module. The entry's streaming settings travel
in the `queue_config` dict the host already passes to its child (key `expert_stream`); the child
takes them out, sets the load_model interception for its model folder, and runs the host's own
worker unchanged. An entry without settings (dense, or not streamed) gets no interception."""

from __future__ import annotations

KEY = "expert_stream"


def child_worker(model_cfg_dict, queue_config, *rest):
    from expert_stream.plugin.hosts.openai.compat import host_worker, serve_stats

    stream = queue_config.pop(KEY, None) if isinstance(queue_config, dict) else None
    original = host_worker()  # this process never patched it: the host's own
    if stream is None:
        return original(model_cfg_dict, queue_config, *rest)
    from expert_stream.plugin.hosts import interception

    interception.install()
    interception.set_targets({stream["model_path"]: interception.Target(stream["model_id"], stream["settings"])})
    serve_stats(interception.stats)  # the parent's status endpoint asks for them
    try:
        return original(model_cfg_dict, queue_config, *rest)
    finally:
        interception.forget(stream["model_id"])

