"""What one sequence's caches (KV, sliding windows, SSM state) take, as a function of its length.

Measured from the model's own cache objects (mlx-lm's `make_prompt_cache`): a lazily built
model called on one token, then on a second, with nothing evaluated, gives every cache array's
shape and dtype without reading a weight. A cache that grew between the two calls grows per
token (up to its window, for rotating and chunked caches); one that did not is constant-size
(SSM state). Only when that fails does a formula from config.json stand in (full attention in
every layer, bf16), and the cost says which it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCost:
    fixed_bytes: int  # state that does not grow with the sequence (SSM caches)
    per_token_bytes: int  # caches that grow with every token
    windowed: tuple = ()  # (bytes per token, window in tokens) of rotating / chunked caches
    source: str = "measured from the model's caches"

    def bytes_for(self, tokens: int) -> int:
        return (self.fixed_bytes + self.per_token_bytes * tokens
                + sum(per * min(tokens, window) for per, window in self.windowed))

    def describe(self, tokens: int) -> str:
        return f"{tokens} tokens, {self.source}"


def kv_cost(model, config: dict) -> KVCost:
    """Measured from `model` (lazily built, never evaluated here), else the config formula."""
    try:
        return measure(model)
    except Exception as exc:  # any model this cannot drive: say so in the cost's source
        return formula(config, f"{type(exc).__name__}: {exc}")


def measure(model) -> KVCost:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    token = mx.zeros((1, 1), dtype=mx.int32)
    model(token, cache=caches)  # builds the graph only: shapes and dtypes, no data
    leaves = list(_leaves(caches))
    one = [_state_bytes(c) for c in leaves]
    model(token, cache=caches)
    two = [_state_bytes(c) for c in leaves]
    fixed = per_token = 0
    windowed = []
    for cache, b1, b2 in zip(leaves, one, two):
        grows = b2 - b1
        fixed += b1 - grows
        window = getattr(cache, "max_size", None) or getattr(cache, "chunk_size", None)
        if grows and window:
            windowed.append((grows, int(window)))
        else:
            per_token += grows
    if fixed < 0 or per_token < 0 or not (per_token or windowed or fixed):
        raise ValueError(f"caches measured {one} then {two} bytes")
    return KVCost(fixed, per_token, tuple(windowed))


def formula(config: dict, why: str = "") -> KVCost:
    """Upper bound from config.json: full attention in every layer, bf16 keys and values."""
    cfg = config.get("text_config") or config
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads))
    note = f" (measuring the caches failed: {why})" if why else ""
    return KVCost(0, 2 * layers * kv_heads * head_dim * 2, (),
                  f"formula from config.json: full attention in every layer, bf16{note}")


def _leaves(caches):
    for cache in caches:
        if hasattr(cache, "caches"):  # CacheList: one layer's several caches
            yield from _leaves(cache.caches)
        else:
            yield cache


def _state_bytes(cache) -> int:
    from mlx.utils import tree_flatten

    if getattr(cache, "keys", True) is None:  # a KV cache no call has filled
        return 0
    return sum(a.nbytes for _, a in tree_flatten(cache.state) if hasattr(a, "nbytes"))
