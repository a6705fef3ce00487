"""`budget_gib: auto` in the engine: the budget is the limit minus the stated terms, peak RSS of a
generation stays under the limit, a second load counts the first and grows when it closes, a
budget that does not fit is refused with every term named, and a budget changed in the middle
of a generation (shrink and grow) keeps every logit bitwise stock's."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import expert_stream
from exactness import load_pair, prompt_ids
from expert_stream.streaming.auto_budget import LEDGER, share
from expert_stream.streaming.errors import BudgetError
from expert_stream.streaming.footprint import checkpoint_footprint

GIB = 1 << 30
MB = 1 << 20


def test_share_splits_by_expert_bytes_caps_and_floors():
    # Each its smallest budget, then the same share of what each could still use.
    assert share(300, [(100, 10), (400, 40)]) == [60, 240]
    assert share(100, [(100, 10), (300, 30)]) == [25, 75]
    assert share(1000, [(100, 10), (300, 30)]) == [100, 300]  # none beyond its own experts
    assert share(45, [(100, 10), (300, 30)]) == [12, 33]  # floors first; rounding's bytes to the first
    with pytest.raises(BudgetError) as err:
        share(35, [(100, 10), (300, 30)])
    assert err.value.args[1] == 1  # the first model whose smallest budget does not fit


CHILD = textwrap.dedent(
    """
    import json, sys
    import mlx_lm, expert_stream
    sys.path.insert(0, sys.argv[2])
    from rss_sampler import PeakRSS
    kwargs = json.loads(sys.argv[3])
    with PeakRSS() as m:
        model, tokenizer, handle = expert_stream.load(sys.argv[1], **kwargs)
        mlx_lm.generate(model, tokenizer, "hello " * 64, max_tokens=24)
    print(json.dumps({"peak": m.peak, "base": m.base, "budget": handle.stats()["budget"],
                      "target": handle.budget.target_bytes, "slot_bytes": handle.budget_bytes,
                      "misses": handle.stats()["totals"]["misses"]}))
    """
)


def test_auto_is_the_limit_minus_its_terms_and_rss_stays_under(checkpoints):
    """A checkpoint whose experts are three times what auto leaves for them, under a limit set
    with memory_gib: the budget equals the limit minus trunk, KV cache, MLX cache and headroom,
    and the whole process's peak RSS while it loads and generates stays under the limit."""
    path = checkpoints("qwen3_moe", layers=8, experts=64, top_k=4, hidden=1024, moe_hidden=1024, shard_size_mb=256)
    fp = checkpoint_footprint(path)
    context, cache_gib, headroom_gib = 512, 0.25, 0.75
    kv = fp.kv.bytes_for(context)
    limit = int(cache_gib * GIB) + int(headroom_gib * GIB) + fp.trunk_bytes + kv + fp.expert_bytes // 3
    kwargs = {"memory_gib": limit / GIB, "headroom_gib": headroom_gib, "mlx_cache_limit_gib": cache_gib,
              "context_length": context}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(Path(__file__).parents[1]), json.dumps(kwargs)],
                         capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    expected = limit - fp.trunk_bytes - kv - int(cache_gib * GIB) - int(headroom_gib * GIB)
    assert r["target"] == expected == fp.expert_bytes // 3
    terms = {t["name"]: t for t in r["budget"]["why"]["terms"]}
    assert list(terms) == ["trunk", "KV cache", "MLX cache", "headroom"]
    assert terms["KV cache"]["note"] == "512 tokens, measured from the model's caches"
    assert r["budget"]["auto"] and r["budget"]["why"]["limit_source"] == "memory_gib"
    assert r["slot_bytes"] <= r["target"] and r["misses"] > 0  # it streamed, within its budget
    print(f"limit {limit / MB:.0f} MB, budget {r['target'] / MB:.0f} MB, experts {fp.expert_bytes / MB:.0f} MB: "
          f"peak RSS {r['peak'] / MB:.0f} MB (before loading {r['base'] / MB:.0f} MB)")
    assert r["peak"] < limit


def test_a_budget_too_small_is_refused_with_every_term(checkpoints):
    path = checkpoints("qwen3_moe", layers=2)
    with pytest.raises(BudgetError) as err:
        expert_stream.load(path, memory_gib=1.5)
    message = str(err.value)
    assert str(path) in message and "below the smallest budget" in message
    assert "the limit is 1.50 GiB (memory_gib)" in message
    for term in ("trunk", "KV cache", "MLX cache 1.000 GiB", "headroom 1.000 GiB"):
        assert term in message
    assert "set a budget_gib number" in message and "context_length" in message


def test_a_second_load_counts_the_first_and_grows_when_it_closes(checkpoints):
    """A takes every expert; B gets what is left (half its experts); A closes and B's auto
    budget grows to every expert, its layers following at their next calls: every logit stays
    stock's."""
    gc.collect()
    path = checkpoints("qwen3_moe", layers=4)
    fp = checkpoint_footprint(path)
    context, cache = 64, 2 * MB
    fixed = fp.trunk_bytes + fp.kv.bytes_for(context)
    left_over = LEDGER.others()[0]  # models an earlier test left loaded in this process
    limit = cache + left_over + 2 * fixed + fp.expert_bytes + fp.expert_bytes // 2
    kwargs = dict(memory_gib=limit / GIB, headroom_gib=0, mlx_cache_limit_gib=cache / GIB, context_length=context,
                  policy="lru")
    _, _, first = expert_stream.load(path, **kwargs)
    assert first.budget.target_bytes == fp.expert_bytes and first.resident_bytes == fp.expert_bytes
    stock, _ = __import__("mlx_lm").utils.load_model(Path(path))
    second_model, _, second = expert_stream.load(path, **kwargs)
    assert second.budget.target_bytes == fp.expert_bytes // 2
    others = {t["name"]: t for t in second.stats()["budget"]["why"]["terms"]}["other models"]
    assert others["gib"] == round((left_over + fixed + fp.expert_bytes) / GIB, 4)
    steps = decode_with_changes(stock, second_model, {8: first.close})
    assert second.budget.target_bytes == fp.expert_bytes  # grew into what the first held
    assert second.budget_bytes == fp.expert_bytes  # every layer reached it
    assert steps == 24
    second.close()


def decode_with_changes(stock, streamed, changes: dict, steps: int = 24, prompt: int = 12) -> int:
    """Prefill, then decode greedily; before decode step i, `changes[i]()` runs. Every logit
    must equal stock's bitwise. Returns the steps compared."""
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    ids = prompt_ids(prompt)
    a, b = stock(ids, cache=c1), streamed(ids, cache=c2)
    mx.eval(a, b)
    assert mx.array_equal(a, b).item(), "prefill logits differ"
    token = mx.argmax(a[:, -1:], axis=-1)
    for i in range(steps):
        if i in changes:
            changes[i]()
        a, b = stock(token, cache=c1), streamed(token, cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item(), f"decode step {i}: logits differ"
        token = mx.argmax(a[:, -1:], axis=-1)
    return steps


@pytest.mark.parametrize("at_once", [False, True])  # at each layer's next call, or apply_budget() now
@pytest.mark.parametrize("prefetch", [False, True])  # True: resizes meet lookahead reads in flight
def test_budget_changes_mid_generation_keep_logits_bitwise(checkpoints, at_once, prefetch):
    path = checkpoints("qwen3_moe", layers=4)
    fp = checkpoint_footprint(path)
    row, experts = fp.bytes_per_slot_row, max(fp.num_experts)
    stock, streamed, handle = load_pair(path, slots=6, policy="default", prefetch=prefetch)
    seen = []

    def change(slots):
        def run():
            handle.set_budget(slots * row)
            if at_once:
                handle.apply_budget()
                assert sum(s.cache.num_slots for s in handle.streams) == slots * len(handle.streams)
            seen.append((slots, [s.cache.num_slots for s in handle.streams]))
        return run

    def check_total():
        assert handle.budget_bytes <= handle.budget.target_bytes

    decode_with_changes(stock, streamed, {4: change(fp.top_k), 8: check_total, 10: change(experts),
                                          16: change(5), 20: check_total})
    got = [s.cache.num_slots for s in handle.streams]
    assert sum(got) == 5 * 4 and min(got) >= fp.top_k, got  # every layer followed, none below a token's experts
    assert [slots for slots, _ in seen] == [fp.top_k, experts, 5]
    assert handle.stats()["budget"]["budget_gib"] == round(5 * row / GIB, 4)
    handle.close()

