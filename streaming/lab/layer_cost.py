"""The host cost of one streamed layer's decode call (benchmark lab code): wall time of the
call (graph building and the engine's host work; the device work it waits for is a single
token's on tiny experts) and the Python-visible calls it makes (`sys.setprofile`'s call and
c_call events), for a call whose experts all sit in slots and for one with a miss, beside stock
`SwitchGLU` on the same checkpoint.

    python -m expert_stream.streaming.lab.layer_cost [--policy default] [--calls 400] [--decode-path native]

With `--decode-path native` a miss is read inside the evaluation, outside the
timed build: the figure is the Python thread's part, which is what the native path removes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def count_calls(fn) -> int:
    """Python-visible calls (functions and C functions) one `fn()` makes."""
    n = 0

    def profile(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def _timed(call, routes, calls: int) -> float:
    """Median microseconds of `call(indices)` over `calls` calls cycling through `routes`, the
    output evaluated after each call, outside the timing (decode evaluates a token's whole graph
    once)."""
    times = []
    for i in range(calls):
        idx = routes[i % len(routes)]
        t0 = time.perf_counter()
        y = call(idx)
        times.append(time.perf_counter() - t0)
        mx.eval(y)
    return float(np.median(times)) * 1e6


def measure(model_dir: Path, policy: str, calls: int, decode_path: str = "python") -> dict:
    from mlx_lm.utils import load_model

    import expert_stream
    from ..footprint import checkpoint_footprint
    from ..streamed_switch import StreamedSwitch

    fp = checkpoint_footprint(model_dir)
    k = fp.top_k
    slots = fp.num_experts[0] // 2
    streamed, _, handle = expert_stream.load(model_dir, budget_gib=fp.budget_gib_for_slots(slots), policy=policy,
                                             online_budget=False, prefetch=None if decode_path == "native" else False,
                                             decode_path=decode_path)
    if handle.decode_path[0] != decode_path:
        raise SystemExit(f"decode_path {decode_path} does not serve here: {handle.decode_path[1]}")
    layer = next(m for _, m in streamed.named_modules() if isinstance(m, StreamedSwitch))
    stock, _ = load_model(model_dir)
    stock_layer = next(m for name, m in stock.named_modules() if type(m).__name__ in ("SwitchGLU", "SwitchMLP"))
    rng = np.random.default_rng(0)
    hidden = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
    x = mx.array(rng.standard_normal((1, 1, hidden)).astype(np.float32))
    cache = layer.store.cache
    # Fill the slots with experts 0..slots-1, then: hits route among them; a miss call routes one
    # expert outside them (evicting one of the others, which the next miss call brings back).
    warm = [mx.array(np.arange(i, i + k, dtype=np.uint32).reshape(1, 1, k)) for i in range(0, slots - k + 1, k)]
    for idx in warm:
        mx.eval(layer(x, idx))
    hit_routes = [mx.array(rng.choice(slots // 2, k, replace=False).astype(np.uint32).reshape(1, 1, k))
                  for _ in range(64)]
    miss_routes = []
    for i in range(64):
        ids = rng.choice(slots // 2, k, replace=False).astype(np.uint32)
        ids[-1] = slots + i % (fp.num_experts[0] - slots)
        miss_routes.append(mx.array(ids.reshape(1, 1, k)))

    def streamed_call(idx):
        return layer(x, idx)

    def stock_call(idx):
        return stock_layer(x, idx)

    figures = {}
    for name, call, routes in (("stock SwitchGLU", stock_call, hit_routes), ("streamed, all hits", streamed_call, hit_routes),
                               ("streamed, one miss", streamed_call, miss_routes)):
        us = _timed(call, routes, calls)
        idx = routes[0]
        if routes is miss_routes:  # one expert certainly out of the slots
            ids = np.array(idx).reshape(-1)
            ids[-1] = np.flatnonzero(cache.slot_of < 0)[-1]
            idx = mx.array(ids.reshape(1, 1, k))
        n = count_calls(lambda: mx.eval(call(idx)))
        figures[name] = (us, n)
    misses = cache.stats.misses
    handle.close()
    return {"figures": figures, "misses": misses, "slots": slots, "experts": fp.num_experts[0], "top_k": k}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint (default: a small synthetic qwen3_moe)")
    parser.add_argument("--policy", default="default")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--decode-path", default="python", choices=("python", "native"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.checkpoint
        if model_dir is None:
            from .synthetic import make_checkpoint

            model_dir = make_checkpoint(Path(tmp) / "ckpt", arch="qwen3_moe", layers=2, experts=64, top_k=8,
                                        hidden=256, moe_hidden=128, dtype="float32", progress=False)
        out = measure(model_dir, args.policy, args.calls, args.decode_path)
    print(f"{out['experts']} experts, {out['slots']} slots a layer, top-{out['top_k']}, policy {args.policy}, "
          f"decode path {args.decode_path}, {mx.default_device()}")
    print(f"{'call':<22} {'host us':>9} {'Python calls':>13}")
    for name, (us, n) in out["figures"].items():
        print(f"{name:<22} {us:>9.0f} {n:>13}")


if __name__ == "__main__":
    main()
