"""`expert_stream.load`: the engine's loader, with what the installed plugins registered."""

from __future__ import annotations

from pathlib import Path


def load(path, budget_gib=None, *, tokenizer_config=None, model_config=None, pipeline_group=None,
         trust_remote_code=False, **settings):
    """Load an MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle); see `expert_stream.streaming.loader.load`. The
    architectures come from the `register_architectures` hook (built-ins and installed
    plugins); `detect_moe` plugins decide whether it is an MoE checkpoint, and
    `validate_settings` plugins may refuse the settings, before anything loads.
    `pipeline_group` (an mlx.distributed group): this process is one rank of mlx-lm's pipeline
    and streams only its own layers. `trust_remote_code`: allow a `model_file` of the checkpoint
    to run (refused otherwise).
    """
    from expert_stream.plugin import plugins
    from expert_stream.plugin.hosts import prefill_step
    from expert_stream.plugin.paths import resolve_model_path
    from expert_stream.streaming import loader
    from expert_stream.streaming.architectures import check_streamable
    from expert_stream.streaming.checkpoint import CheckpointIndex, NeededTensors
    from expert_stream.streaming.errors import NotMoEError
    from expert_stream.streaming.settings import StreamSettings

    path = resolve_model_path(str(path))  # `~`, $VARS, or a hub id in the local HF cache
    pm = plugins.get_plugin_manager()
    where = f"expert_stream.load({str(path)!r})"
    if budget_gib is not None:
        settings["budget_gib"] = budget_gib
    stream_settings = StreamSettings.from_mapping(settings, where=where)
    # A pipeline rank may hold only its own layers' shards: index what is here to detect MoE.
    here = None if pipeline_group is None else NeededTensors(frozenset(), f"rank {pipeline_group.rank()}")
    index = CheckpointIndex(Path(path).expanduser(), needed=here)
    check_streamable(index.model_type, index.model_dir)  # a family that cannot stream says so first
    if not pm.hook.detect_moe(index=index):
        raise NotMoEError(
            f"{index.model_dir}: model_type {index.model_type!r} has no routed-expert layers (no "
            "detect_moe plugin found experts to stream); load it with mlx_lm.load"
        )
    pm.hook.validate_settings(settings=stream_settings, model_path=str(path), where=where)
    model, tokenizer, handle = loader.load_streamed(
        path, stream_settings, architectures=plugins.architectures(pm),
        tokenizer_config=tokenizer_config, model_config=model_config,
        index=index if pipeline_group is None else None, pipeline_group=pipeline_group,
        trust_remote_code=trust_remote_code,
    )
    prefill_step.install()  # mlx_lm.generate / stream_generate chunk prompts by its prefill_step
    prefill_step.register(model, handle.settings.prefill_step)
    pm.hook.model_loaded(model_id=str(path), model_path=str(path), handle=handle)
    return model, tokenizer, handle
