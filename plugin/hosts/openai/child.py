"""What runs first in each model process mlx-openai-server spawns (multi-model mode).

The parent replaces the host's `_handler_worker` with `child_worker`, so the spawn pickles this
function by name and the child imports this small module. The entry's streaming settings travel
in the `queue_config` dict the host already passes to its child (key `expert_stream`); the child
takes them out, sets the load_model interception for its model folder, starts the writer of its
live counters (live_counters.py), and runs the host's own worker unchanged. An entry without
settings (dense, or not streamed) gets no interception."""

from __future__ import annotations

import logging

KEY = "expert_stream"


def child_worker(model_cfg_dict, queue_config, *rest):
    from expert_stream.plugin.hosts.openai import compat

    stream = queue_config.pop(KEY, None) if isinstance(queue_config, dict) else None
    original = compat.host_worker()  # this process never patched it: the host's own
    if stream is None:
        return original(model_cfg_dict, queue_config, *rest)
    from expert_stream.plugin.hosts import interception
    from expert_stream.plugin.hosts.openai import live_counters

    interception.install()
    if not compat.drop_prompt_cache_on_errors():
        logging.getLogger("expert_stream").warning(
            "expert-stream: %s: this mlx-openai-server keeps no prompt cache the plugin knows; a failed "
            "generation's cache is left to the host", stream["model_id"])
    interception.set_targets({stream["model_path"]: _target(stream)})
    compat.add_handler_methods(expert_stream_stats=_expert_stream_stats,
                               expert_stream_set_budget=_expert_stream_set_budget)
    row = stream.get("counters")
    if row is not None:
        live_counters.start_writer(row, stream["model_id"])
    try:
        return original(model_cfg_dict, queue_config, *rest)
    finally:
        if row is not None:
            live_counters.write(row, stream["model_id"])  # the last figures, as the process stops
        interception.forget(stream["model_id"])


def _target(stream: dict):
    from expert_stream.plugin.hosts import interception
    from expert_stream.streaming.auto_budget import HandedBudget

    budget = stream.get("budget")
    return interception.Target(stream["model_id"], stream["settings"], HandedBudget(**budget) if budget else None,
                               trust_remote_code=stream.get("trust_remote_code", False))


async def _expert_stream_stats(self):
    from expert_stream.plugin.hosts import interception

    return interception.stats()


async def _expert_stream_set_budget(self, model_id: str, budget: dict):
    """The parent resolved this model's auto budget again (a model loaded or unloaded beside
    it): the slots move now on the model's own thread, between two requests (or, on a host
    without that thread, at each layer's next call). Returns the budget as it stands."""
    from expert_stream.plugin.hosts import interception
    from expert_stream.plugin.hosts.openai import compat
    from expert_stream.streaming.auto_budget import HandedBudget

    status = interception.set_budget(model_id, HandedBudget(**budget))
    if status is not None:
        await compat.on_compute_thread(self, lambda: interception.apply_budget(model_id))
    return status
