import cProfile, pstats, sys, time, io
import mlx.core as mx, numpy as np
import expert_stream.streaming.loader as loader
from mlx_lm.generate import generate_step
ck, budget, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
extra = dict(kv.split("=") for kv in sys.argv[4:])
extra = {k: (v == "true" if v in ("true", "false") else v) for k, v in extra.items()}
model, _, h = loader.load(ck, budget_gib=budget, slot_write=mode, policy="lru", **extra)
def gen(n_prompt, n_gen, seed):
    p = mx.array(np.random.default_rng(seed).integers(3, 1000, n_prompt), dtype=mx.int32)
    t = time.perf_counter(); first = None; n = 0
    for tok, _ in generate_step(p, model, max_tokens=n_gen):
        n += 1
        if first is None: first = time.perf_counter()
    end = time.perf_counter()
    return first - t, (n - 1) / (end - first)
print(mode, "warm", gen(16, 4, 1))
pr = cProfile.Profile(); pr.enable()
pf, dec = gen(128, 24, 2)
pr.disable()
print(mode, f"prefill 128 tok {pf:.2f}s, decode {dec:.2f} tok/s", h.stats()["totals"])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[:7000]); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[:7000])
