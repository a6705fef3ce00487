"""`expert_stream.load`: the engine's loader, with the architectures plugins registered."""

from __future__ import annotations


def load(path, budget_gib=None, **settings):
    """Load an MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle); see `expert_stream.streaming.loader.load`.
    """
    from expert_stream.streaming import loader

    return loader.load(path, budget_gib=budget_gib, **settings)
