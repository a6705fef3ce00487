# Usage (device): python3 tests/gpu/stock_checked.py CHECKPOINT ROUNDS VARIANT...
# The ceiling of checking routing as a step runs, measured on stock itself: stock mlx-lm (every
# expert resident, nothing streamed) made to do what a speculative step does besides streaming.
# For models whose decoder layers hold a SwitchGLU at mlp.switch_mlp (the benchmark's qwen3_moe).
# VARIANT "cN" hands the step to the device every N MoE layers (async_eval) and reads back the
# routing of the group handed before (as streaming/pass_checks.py does); "c0" reads all of a
# step's routing once at its end; "stock" is untouched. Interleaved through generate_step in one
# process, order rotated each round, one JSON line per run.
import json, sys, time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load_model

from expert_stream.streaming.bench import _prompt, _vocab, timed_generation

ck, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
model, _ = load_model(Path(ck))
state = {"every": None, "open": [], "handed": None, "reads": 0, "read_s": 0.0}


def check(group):
    t = time.perf_counter()
    ids = np.array(group)  # waits for the group, not for work queued after it
    state["read_s"] += time.perf_counter() - t
    state["reads"] += 1
    np.unique(ids)


class CheckedSwitch(SwitchGLU):
    def __call__(self, x, indices):
        y = super().__call__(x, indices)
        every = state["every"]
        if every is None or indices.size != indices.shape[-1]:  # stock, or a prefill chunk
            return y
        state["open"].append(indices.reshape(-1))
        if every and len(state["open"]) >= every:
            routing = mx.concatenate(state["open"])
            state["open"] = []
            mx.async_eval(y, routing)
            handed, state["handed"] = state["handed"], routing
            if handed is not None:
                check(handed)
        return y


base = type(model)
class CheckedModel(base):
    def __call__(self, *a, **k):
        out = base.__call__(self, *a, **k)
        rest = ([state["handed"]] if state["handed"] is not None else []) + state["open"]
        state["handed"], state["open"] = None, []
        if rest and state["every"] is not None:
            check(mx.concatenate(rest))
        return out
model.__class__ = CheckedModel
for layer in model.model.layers:
    switch = getattr(getattr(layer, "mlp", None), "switch_mlp", None)
    if isinstance(switch, SwitchGLU):
        switch.__class__ = CheckedSwitch

for r in range(rounds):
    prompt = _prompt(_vocab(model), 512, seed=r)
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
        state.update(every=None if v == "stock" else int(v[1:]), reads=0, read_s=0.0)
        res = timed_generation(model, prompt, 64, 2048)
        print(json.dumps({"round": r, "variant": v, "decode_tok_s": round(res["decode_tok_s"], 2),
                          "reads": state["reads"], "read_ms": round(1e3 * state["read_s"], 1)}), flush=True)
