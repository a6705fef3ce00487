# Usage (device): python3 tests/gpu/spec_variants.py CHECKPOINT BUDGET_GIB ROUNDS VARIANT...
# Decode speed of speculation schedules side by side in one process, interleaved, with stock:
# each round, every variant and stock generate from the same 512-token prompt (a new prompt
# per round). VARIANT is a speculate_check_every value (0: one check at a pass's end), or
# "layered" (speculation off); a value may end in "n" (no likely reads at a cut). The variants'
# order rotates each round: a variant run right after a new prompt starts from a colder cache
# (in one run the first variant of a round threw 3-25% more passes than the same schedule run
# later in the round). Prints one JSON line per run.
import json, sys
from pathlib import Path

from mlx_lm.utils import load_model

from expert_stream.streaming import loader
from expert_stream.streaming.bench import _prompt, _vocab, timed_generation

ck, budget, rounds, variants = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
model, _, handle = loader.load(ck, budget_gib=budget)
stock, _ = load_model(Path(ck))
spec = handle.speculation
orig_likely = spec.checks.likely_misses
no_likely = False
def likely():
    found = orig_likely()  # read anyway: it also forgets the cut's group
    return {} if no_likely else found
spec.checks.likely_misses = likely
for r in range(rounds):
    prompt = _prompt(_vocab(stock), 512, seed=r)
    for v in variants[r % len(variants):] + variants[:r % len(variants)] + ["stock"]:
        if v == "stock":
            res = timed_generation(stock, prompt, 64, 2048)
            print(json.dumps({"round": r, "variant": v, "decode_tok_s": round(res["decode_tok_s"], 2)}), flush=True)
            continue
        spec._pause = 10**9 if v == "layered" else 0
        no_likely = v.endswith("n")
        spec.checks.every = 0 if v == "layered" else int(v.rstrip("n"))
        before = spec.stats.as_dict()
        res = timed_generation(model, prompt, 64, 2048)
        after = spec.stats.as_dict()
        delta = {k: after[k] - before[k] for k in ("steps", "passes_thrown", "passes_cut", "fallbacks", "layers_replayed", "layers_computed")}
        print(json.dumps({"round": r, "variant": v, "decode_tok_s": round(res["decode_tok_s"], 2), **delta}), flush=True)
