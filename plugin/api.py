"""`expert_stream.load`: the engine's loader, with what the installed plugins registered."""

from __future__ import annotations

from expert_stream.streaming.auto_budget import HEADROOM_GIB


def load(path, budget_gib=None, *, tokenizer_config=None, model_config=None, pipeline_group=None,
         trust_remote_code=False, memory_gib=None, headroom_gib=HEADROOM_GIB, **settings):
    """Load an MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle); see `expert_stream.streaming.loader.load`. The
    architectures come from the `register_architectures` hook (built-ins and installed
    plugins); `detect_moe` plugins decide whether it is an MoE checkpoint, and
    `validate_settings` plugins may refuse the settings, before anything loads.
    `budget_gib` unset (or "auto") fits the budget to memory: what this process may use (or
    `memory_gib`) minus the trunk, the KV cache for `context_length` tokens, MLX's buffer cache,
    the models loaded before in this process and `headroom_gib`.
    `pipeline_group` (an mlx.distributed group): this process is one rank of mlx-lm's pipeline
    and streams only its own layers. `trust_remote_code`: allow a `model_file` of the checkpoint
    to run (refused otherwise).
    """
    from expert_stream.plugin import plugins
    from expert_stream.plugin.hosts import prefill_step
    from expert_stream.plugin.paths import resolve_model_path
    from expert_stream.streaming import loader

    path = resolve_model_path(str(path))  # `~`, $VARS, or a hub id in the local HF cache
    pm = plugins.get_plugin_manager()
    model, tokenizer, handle = loader.load(
        path, budget_gib, hooks=plugins.load_hooks(pm), tokenizer_config=tokenizer_config, model_config=model_config,
        pipeline_group=pipeline_group, trust_remote_code=trust_remote_code, memory_gib=memory_gib,
        headroom_gib=headroom_gib, **settings,
    )
    prefill_step.install()  # mlx_lm.generate / stream_generate chunk prompts by its prefill_step
    prefill_step.register(model, handle.settings.prefill_step, handle.decode, handle.prefill)
    pm.hook.model_loaded(model_id=str(path), model_path=str(path), handle=handle)
    return model, tokenizer, handle
