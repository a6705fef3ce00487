"""mlx_lm.server's --draft-model loads a model whole beside the streamed one: the next auto
budget counts it (through the process's ledger)."""

from __future__ import annotations

import gc
from pathlib import Path

import expert_stream
from expert_stream.streaming.auto_budget import LEDGER
from expert_stream.streaming.footprint import checkpoint_footprint

GIB = 1 << 30
MB = 1 << 20


def test_a_model_held_whole_beside_counts_against_auto(checkpoints):
    """A draft model (loaded whole beside the streamed one) is a term of the next auto budget:
    mlx_lm.server's --draft-model holds one, counted through the ledger."""
    from expert_stream.plugin.hosts.mlx_lm.reloader import hold_draft
    from expert_stream.streaming.checkpoint import CheckpointIndex

    gc.collect()
    path = checkpoints("qwen3_moe", layers=4)
    fp = checkpoint_footprint(path)
    context, cache = 64, 2 * MB
    fixed = fp.trunk_bytes + fp.kv.bytes_for(context)
    draft = CheckpointIndex(Path(path)).total_bytes()
    limit = cache + LEDGER.others()[0] + fixed + draft + fp.expert_bytes // 2
    kwargs = dict(memory_gib=limit / GIB, headroom_gib=0, mlx_cache_limit_gib=cache / GIB, context_length=context)
    try:
        hold_draft(path)  # any checkpoint folder: its size is what counts
        _, _, handle = expert_stream.load(path, **kwargs)
        assert handle.budget.target_bytes == fp.expert_bytes // 2
        assert "draft model" in {t["name"]: t for t in handle.stats()["budget"]["why"]["terms"]}["other models"]["note"]
        handle.close()
        hold_draft(None)  # the next load has no draft: nothing held
        _, _, handle = expert_stream.load(path, **kwargs)
        assert handle.budget.target_bytes == fp.expert_bytes
        handle.close()
    finally:
        hold_draft(None)
