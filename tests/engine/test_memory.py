"""Peak memory: a checkpoint whose experts are many times the budget loads and decodes with
peak RSS below trunk + budget + a stated margin (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from expert_stream.streaming.footprint import checkpoint_footprint

MB = 1 << 20
# What besides trunk and slots a streamed model may hold: MLX temporaries of a prefill chunk
# and a decode step, the prefill scratch buffers (2 x 8 experts), the KV cache, the tokenizer,
# and allocator slack. Stated here, checked below.
MARGIN_BYTES = 256 * MB

CHILD = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import mlx_lm, expert_stream
    sys.path.insert(0, sys.argv[3])
    from rss_sampler import PeakRSS
    with PeakRSS() as m:
        model, tokenizer, handle = expert_stream.load(sys.argv[1], budget_gib=float(sys.argv[2]))
        text = mlx_lm.generate(model, tokenizer, "hello " * 64, max_tokens=12)
    stats = handle.stats()["totals"]
    print(json.dumps({"baseline": m.base, "peak": m.peak, "bytes_read": stats["bytes_read"],
                      "misses": stats["misses"], "slot_bytes": handle.budget_bytes,
                      "scratch": handle.layers[0].sweep.scratch.nbytes}))
    """
)


def test_peak_rss_below_trunk_plus_budget(checkpoints):
    path = checkpoints(
        "qwen3_moe", layers=8, experts=64, top_k=4, hidden=1024, moe_hidden=1024, shard_size_mb=256
    )
    fp = checkpoint_footprint(path)
    assert fp.expert_bytes > 900 * MB
    budget_gib = fp.min_budget_gib * 1.5
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(budget_gib), str(Path(__file__).resolve().parents[1])],
        capture_output=True, text=True, timeout=600, check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["baseline"]
    budget = budget_gib * (1 << 30)
    print(
        f"experts {fp.expert_bytes / MB:.0f} MB, trunk {fp.trunk_bytes / MB:.0f} MB, budget "
        f"{budget / MB:.0f} MB, scratch {r['scratch'] / MB:.0f} MB: RSS grew {grown / MB:.0f} MB "
        f"(baseline {r['baseline'] / MB:.0f} MB), read {r['bytes_read'] / MB:.0f} MB"
    )
    assert fp.expert_bytes > 10 * budget  # experts are many times the budget
    assert r["misses"] > 0 and r["bytes_read"] > budget  # it really streamed
    assert grown < fp.trunk_bytes + budget + MARGIN_BYTES


def test_mostly_hit_decode_holds_a_bounded_number_of_outputs(checkpoints):
    """A long decode whose experts nearly all hit: each layer keeps at most PIN_BOUND outputs
    pinned (they once piled up until the layer's next miss: memory that grew with the session),
    and the logits stay bitwise stock's while pins are let go."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from exactness import load_pair, prompt_ids
    from expert_stream.streaming.expert_store import PIN_BOUND

    path = checkpoints("qwen3_moe", layers=2)
    experts = checkpoint_footprint(path).num_experts[0]
    stock, streamed, handle = load_pair(path, slots=experts - 2, prefetch=False, online_budget=False)
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    token = prompt_ids(8)
    most = 0
    for _ in range(120):
        a, b = stock(token, cache=c1), streamed(token, cache=c2)
        token = mx.argmax(b[:, -1:], axis=-1)
        mx.async_eval(token)  # decode's one step ahead
        assert mx.array_equal(a, b).item()
        most = max(most, max(len(s.pending) for s in handle.streams))
    totals = handle.stats()["totals"]
    assert totals["hits"] > 10 * totals["misses"]  # mostly hits: the case that piled up
    assert most <= PIN_BOUND
    handle.close()
