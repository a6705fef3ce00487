# Usage (device): python3 tests/gpu/prof_spec.py CHECKPOINT BUDGET_GIB
# Where a speculative decode step's time goes: graph building (the passes), the routing check,
# the reads of thrown-away passes; misses per step; stock's build and run time for one step.
import cProfile, io, pstats, sys, time
import mlx.core as mx, numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
import expert_stream.streaming.loader as loader

ck, budget = sys.argv[1], float(sys.argv[2])
model, _, h = loader.load(ck, budget_gib=budget)
spec = h.speculation
T = {"build": 0.0, "passes": 0, "check": 0.0, "fetch": 0.0, "steps": 0, "commit": 0.0}
per_step_misses = []
by_passes = {}  # passes in the step -> list of step wall times
from expert_stream.streaming import slots as slots_mod
orig_commit = slots_mod.ExpertSlots.commit
def commit(self, *a):
    t = time.perf_counter(); r = orig_commit(self, *a); T["commit"] += time.perf_counter() - t; return r
slots_mod.ExpertSlots.commit = commit
orig_forward, orig_routing, orig_fetch = spec.forward, spec.checks.finish, spec._fetch

def forward(run, inputs, cache):
    if inputs.size != 1:
        return orig_forward(run, inputs, cache)
    def timed_run():
        t = time.perf_counter(); out = run(); T["build"] += time.perf_counter() - t; T["passes"] += 1; return out
    before = sum(s.cache.stats.misses for s in h.streams)
    p0 = T["passes"]; t0 = time.perf_counter()
    out = orig_forward(timed_run, inputs, cache)
    by_passes.setdefault(T["passes"] - p0, []).append(time.perf_counter() - t0)
    T["steps"] += 1; per_step_misses.append(sum(s.cache.stats.misses for s in h.streams) - before)
    return out

def timed(name, fn):
    def wrapper(*a):
        t = time.perf_counter(); r = fn(*a); T[name] += time.perf_counter() - t; return r
    return wrapper

spec.forward, spec.checks.finish, spec._fetch = forward, timed("check", orig_routing), timed("fetch", orig_fetch)

def gen(seed, n_prompt, n_gen):
    p = mx.array(np.random.default_rng(seed).integers(3, 1000, n_prompt), dtype=mx.int32)
    first = None; n = 0
    for _ in generate_step(p, model, max_tokens=n_gen):
        n += 1
        if first is None: first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)

for adaptive in (True, False):
    spec.adaptive = adaptive
    gen(1, 512, 16)
    h.reset_stats(); per_step_misses.clear(); by_passes.clear()
    T.update(build=0.0, passes=0, check=0.0, fetch=0.0, steps=0, commit=0.0)
    tok_s = gen(2, 512, 64)
    st = h.stats()
    print(f"adaptive={adaptive}: decode {tok_s:.1f} tok/s; per step: build {T['build']/T['steps']*1e3:.1f} ms over "
          f"{T['passes']/T['steps']:.2f} passes, check {T['check']/T['steps']*1e3:.1f} ms, fetch {T['fetch']/T['steps']*1e3:.1f} ms "
          f"(slot commits {T['commit']/T['steps']*1e3:.1f} ms, reads {sum(s.cache.stats.read_seconds for s in h.streams)/T['steps']*1e3:.1f} ms)")
    print("  step wall by passes:", {k: (len(v), round(float(np.mean(v))*1e3, 1)) for k, v in sorted(by_passes.items())})
    print("  speculation", st["speculation"])
    print("  misses per decode step", np.bincount(per_step_misses).tolist(), "miss rate", st["totals"]["misses"] / max(1, st["totals"]["hits"] + st["totals"]["misses"]))
spec.adaptive = False
pr = cProfile.Profile(); pr.enable(); gen(3, 128, 32); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:5000])
h.close()

stock, _ = load_model(__import__("pathlib").Path(ck))
cache = make_prompt_cache(stock)
mx.eval(stock(mx.array([list(range(3, 515))]), cache=cache))
tok = mx.array([[7]]); builds, totals = [], []
for i in range(40):
    t = time.perf_counter(); out = stock(tok, cache=cache); b = time.perf_counter() - t
    mx.eval(out); totals.append(time.perf_counter() - t); builds.append(b)
print(f"stock one step, synchronous: build {np.median(builds)*1e3:.2f} ms, build+run {np.median(totals)*1e3:.2f} ms")
