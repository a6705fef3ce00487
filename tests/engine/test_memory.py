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
