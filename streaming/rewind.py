"""Putting a model's caches back to where they were before a forward pass, so that a decode step
run speculatively (streaming/speculation.py) can be thrown away and run again exactly.

A pass may end early (streaming/pass_checks.py), so a rewind puts each cache back to where it
was, whether or not its layer ran. Each cache kind needs its own way back, and some have none; a
step over a cache without one is simply not speculated:
- KV caches that append (KVCache, QuantizedKVCache, ConcatenateKVCache): trim what the step
  added. What the step wrote past the trimmed offset is overwritten by the rerun.
- RotatingKVCache: the same, while the step cannot wrap (offset + tokens < max_size). Once it
  wraps, a step overwrites entries the rerun still attends to: no way back.
- ChunkedKVCache: keep references to its arrays and counters. A step either writes past the
  offset (harmless, as above) or starts a new chunk with new arrays (the old ones are untouched).
- ArraysCache (SSM / linear-attention state): keep references to its arrays; a step replaces
  them with new arrays and never writes into them. Batched state (lengths, left padding) is
  not handled.
- CacheList: every part must have a way back.
"""

from __future__ import annotations

from typing import Callable, Optional

Rewind = Callable[[], None]


def rewind_point(caches, tokens: int) -> Optional[Rewind]:
    """A function that undoes a forward pass of `tokens` tokens over `caches` (the model's cache
    list), or None when some cache cannot be put back. Call it before the pass."""
    if caches is None:
        return None
    parts = []
    for cache in caches:
        part = _rewind_one(cache, tokens)
        if part is None:
            return None
        parts.append(part)

    def rewind() -> None:
        for part in parts:
            part()

    return rewind


def _rewind_one(cache, tokens: int) -> Optional[Rewind]:
    from mlx_lm.models import cache as kinds

    kind = type(cache)
    if kind is kinds.CacheList:
        return rewind_point(cache.caches, tokens)
    if isinstance(cache, kinds.ArraysCache):
        if cache.lengths is not None or cache.left_padding is not None:
            return None
        saved = list(cache.cache)
        return lambda: setattr(cache, "cache", list(saved))
    if kind is kinds.RotatingKVCache:
        if cache.offset + tokens >= cache.max_size:
            return None
        return _trim_back(cache)
    if kind is kinds.ChunkedKVCache:
        saved = (cache.keys, cache.values, cache.offset, cache.start_position)

        def restore() -> None:
            cache.keys, cache.values, cache.offset, cache.start_position = saved

        return restore
    if kind in (kinds.KVCache, kinds.QuantizedKVCache, kinds.ConcatenateKVCache):
        return _trim_back(cache)
    return None


def _trim_back(cache) -> Rewind:
    """Trim what was added since now (nothing, when the cache's layer did not run)."""
    offset = cache.offset

    def rewind() -> None:
        if cache.offset > offset:
            cache.trim(cache.offset - offset)

    return rewind
