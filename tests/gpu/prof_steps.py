# Usage (device): python3 tests/gpu/prof_steps.py CHECKPOINT BUDGET_GIB [CHECK_EVERY ...]
# Where a speculative decode step's wall time goes, on the benchmark's prompt (512 tokens,
# 64 greedy tokens after a warm-up like the benchmark's), per check schedule:
#   build  - host time building passes, outside the routing reads
#   sync   - waiting on routing reads (group checks inside a pass and the final check)
#   fetch  - reading the experts a thrown pass missed (certain and likely)
#   rewind - trimming caches back;  keep - settling a kept pass
# and the mean step wall by the step's shape (thrown passes, of which cut). Then stock: one step
# run synchronously and the pipelined rate, for comparison.
import sys, time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from expert_stream.streaming import loader, pass_checks, speculation
from expert_stream.streaming.bench import _prompt, _vocab, timed_generation

ck, budget = sys.argv[1], float(sys.argv[2])
schedules = [int(v) for v in sys.argv[3:]] or [4, 0]
model, _, h = loader.load(ck, budget_gib=budget)
spec = h.speculation
spec.adaptive = False
T = defaultdict(float)


def timed(owner, name, key):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[key] += time.perf_counter() - t
    setattr(owner, name, wrapper)


orig_experts = pass_checks._experts
def experts(streams, routing, sizes):
    t = time.perf_counter(); mx.eval(routing); T["sync"] += time.perf_counter() - t
    return orig_experts(streams, routing, sizes)
pass_checks._experts = experts
timed(spec, "_fetch", "fetch")
timed(spec, "_keep", "keep")
orig_rewind_point = speculation.rewind_point
def rewind_point(cache, n):
    rw = orig_rewind_point(cache, n)
    if rw is None:
        return None
    def timed_rewind():
        t = time.perf_counter(); rw(); T["rewind"] += time.perf_counter() - t
    return timed_rewind
speculation.rewind_point = rewind_point
orig_pass = spec._pass
def one_pass(run, below):
    t = time.perf_counter(); s0 = T["sync"]
    try:
        return orig_pass(run, below)
    finally:
        T["pass"] += time.perf_counter() - t
        T["pass_sync"] += T["sync"] - s0
spec._pass = one_pass
orig_forward = spec.forward
steps = []
def forward(run, inputs, cache):
    if inputs.size != 1:
        return orig_forward(run, inputs, cache)
    st0 = dict(spec.stats.as_dict()); T0 = dict(T)
    miss0 = sum(s.cache.stats.misses for s in h.streams)
    t = time.perf_counter()
    out = orig_forward(run, inputs, cache)
    wall = time.perf_counter() - t
    st1 = spec.stats.as_dict()
    steps.append({
        "wall": wall, "thrown": st1["passes_thrown"] - st0["passes_thrown"],
        "cut": st1["passes_cut"] - st0["passes_cut"], "layers": st1["layers_computed"] - st0["layers_computed"],
        "misses": sum(s.cache.stats.misses for s in h.streams) - miss0,
        **{k: T[k] - T0.get(k, 0.0) for k in list(T)},
    })
    return out
spec.forward = forward

stock, _ = load_model(Path(ck))
for every in schedules:
    spec.checks.every = every
    for r in range(2):
        prompt = _prompt(_vocab(stock), 512, seed=r)
        steps.clear()
        res = timed_generation(model, prompt, 64, 2048)
        st = res["decode_tok_s"]
        kept = steps[1:]  # the first step follows the prefill
        n = len(kept)
        mean = lambda k: 1e3 * sum(s.get(k, 0.0) for s in kept) / n
        build = mean("pass") - mean("pass_sync")
        sync = mean("sync")
        print(f"every={every} round {r}: {st:.1f} tok/s, step {mean('wall'):.1f} ms = build {build:.1f} + "
              f"sync {sync:.1f} + fetch {mean('fetch'):.1f} + rewind {mean('rewind'):.2f} + keep {mean('keep'):.1f} "
              f"+ other {mean('wall') - build - sync - mean('fetch') - mean('rewind') - mean('keep'):.1f}; "
              f"thrown {mean('thrown') / 1e3:.2f} (cut {mean('cut') / 1e3:.2f}), layers {mean('layers') / 1e3:.1f}, "
              f"misses {mean('misses') / 1e3:.2f}", flush=True)
        shapes = defaultdict(list)
        for s in kept:
            shapes[(s["thrown"], s["cut"])].append(s)
        for (th, cut), ss in sorted(shapes.items()):
            w = np.mean([s["wall"] for s in ss]) * 1e3
            sy = np.mean([s["sync"] for s in ss]) * 1e3
            fe = np.mean([s["fetch"] for s in ss]) * 1e3
            la = np.mean([s["layers"] for s in ss])
            print(f"   thrown {th} (cut {cut}): {len(ss)} steps, wall {w:.1f} ms, sync {sy:.1f}, fetch {fe:.1f}, layers {la:.0f}")
    res = timed_generation(stock, _prompt(_vocab(stock), 512, seed=0), 64, 2048)
    print(f"stock: {res['decode_tok_s']:.1f} tok/s", flush=True)

cache = make_prompt_cache(stock)
mx.eval(stock(mx.array([list(range(3, 515))]), cache=cache))
tok = mx.array([[7]]); builds, totals = [], []
for i in range(40):
    t = time.perf_counter(); out = stock(tok, cache=cache); b = time.perf_counter() - t
    mx.eval(out); totals.append(time.perf_counter() - t); builds.append(b)
print(f"stock one step, synchronous: build {np.median(builds)*1e3:.2f} ms, build+run {np.median(totals)*1e3:.2f} ms")
h.close()
