# Usage (device): python3 tests/gpu/clean_steps.py CHECKPOINT ROUNDS [PROFILE_TOP]
# The cost of a speculative step that never misses: the engine with every expert read into a
# slot, run (a) speculatively as if experts could be missing ("spec4": checks every 4 layers,
# "spec0": one check at a step's end) and (b) the way it runs when it knows all are resident
# ("resident": no checks), against stock, interleaved in one process (order rotated each round).
# With PROFILE_TOP, one more spec4 run under cProfile prints that many functions by own time.
import cProfile, io, json, pstats, sys
from pathlib import Path

from mlx_lm.utils import load_model

from expert_stream.streaming import loader
from expert_stream.streaming.bench import _prompt, _vocab, timed_generation
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.speculation import DecodeSpeculation, install

ck, rounds = sys.argv[1], int(sys.argv[2])
top = int(sys.argv[3]) if len(sys.argv) > 3 else 0
fp = checkpoint_footprint(ck)
model, _, h = loader.load(ck, budget_gib=fp.budget_gib_for_slots(max(fp.num_experts)) + 1e-3)
# Every expert is loaded, so the loader installed no speculation: install it as for a smaller budget.
spec = DecodeSpeculation(h.streams)
install(model, spec)
stock, _ = load_model(Path(ck))


def setup(variant):
    for s in h.streams:
        s.all_resident = variant == "resident"
    spec.checks.every = 4 if variant == "spec4" else 0
    spec.adaptive, spec._pause = (True, 10**9) if variant == "resident" else (False, 0)


variants = ["spec4", "spec0", "resident", "stock"]
for r in range(rounds):
    prompt = _prompt(_vocab(stock), 512, seed=r)
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
        setup(v)
        before = spec.stats.as_dict()
        res = timed_generation(stock if v == "stock" else model, prompt, 64, 2048)
        thrown = spec.stats.passes_thrown - before["passes_thrown"]
        print(json.dumps({"round": r, "variant": v, "decode_tok_s": round(res["decode_tok_s"], 2),
                          "speculative_steps": spec.stats.steps - before["steps"], "thrown": thrown}), flush=True)
if top:
    setup("spec4")
    prof = cProfile.Profile()
    prof.enable()
    res = timed_generation(model, _prompt(_vocab(stock), 512, seed=99), 64, 2048)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print("profiled spec4 decode tok/s", round(res["decode_tok_s"], 2))
    print(out.getvalue())
