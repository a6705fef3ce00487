"""`expert_stream.load`: the engine's loader, with what the installed plugins registered."""

from __future__ import annotations


def load(path, budget_gib=None, **settings):
    """Load an MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle); see `expert_stream.streaming.loader.load`. The
    architectures come from the `register_architectures` hook (built-ins and installed
    plugins); `validate_settings` plugins may refuse the settings before anything loads.
    """
    from expert_stream.plugin import plugins
    from expert_stream.plugin.hosts import prefill_step
    from expert_stream.plugin.paths import resolve_model_path
    from expert_stream.streaming import loader
    from expert_stream.streaming.settings import StreamSettings

    path = resolve_model_path(str(path))  # `~`, $VARS, or a hub id in the local HF cache
    pm = plugins.get_plugin_manager()
    specs = plugins.architectures(pm)
    where = f"expert_stream.load({str(path)!r})"
    checked = dict(settings)
    if budget_gib is not None:
        checked["budget_gib"] = budget_gib
    engine_keys = {"tokenizer_config", "model_config"}
    stream_settings = StreamSettings.from_mapping(
        {k: v for k, v in checked.items() if k not in engine_keys}, where=where
    )
    pm.hook.validate_settings(settings=stream_settings, model_path=str(path), where=where)
    model, tokenizer, handle = loader.load(path, budget_gib=budget_gib, architectures=specs, **settings)
    prefill_step.install()  # mlx_lm.generate / stream_generate chunk prompts by its prefill_step
    prefill_step.register(model, handle.settings.prefill_step)
    pm.hook.model_loaded(model_id=str(path), model_path=str(path), handle=handle)
    return model, tokenizer, handle
