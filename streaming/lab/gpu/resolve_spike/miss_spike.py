"""Issue 31, stage 2 spike, second part: the miss path inside the primitive (resolve_misses.cpp),
on the CPU backend, against stock mlx-lm and the engine's Python decode path.

A checkpoint's every MoE layer gets `--slots` slots (all empty at the start); the primitive maps
each decode token's expert ids to slots and reads the missing experts' rows from the shards into
LRU victims, inside the evaluation. The driver decodes a text file teacher-forced, one token a
step, in mlx-lm's loop shape (token t+1's graph built and queued before token t is read), and
compares every step's logits bitwise with stock's. Then it cuts a copy of a shard short and
checks that the next miss into it fails from the evaluation, naming the layer, shard, offset and
length, that the slot it was filling claims no expert, and that the layer keeps failing.

Run from the repository root after build.sh, the built module importable:
PYTHONPATH=streaming/lab/gpu/resolve_spike/build python3 streaming/lab/gpu/resolve_spike/miss_spike.py \
    --checkpoint ../shared/models/tiny-code-moe --text FILE [--slots 12] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

import _resolve_misses
from expert_stream.streaming.checkpoint import CheckpointIndex

PARTS = [(proj, part) for proj in ("gate_proj", "up_proj", "down_proj") for part in ("weight", "scales", "biases")]


class ResolvedSwitch(nn.Module):
    """The stock SwitchGLU on `slots` slot rows, its ids resolved (and misses read) by the primitive."""

    def __init__(self, glu: nn.Module, prefix: str, layer: int, slots: int, index: CheckpointIndex):
        super().__init__()
        self.glu = glu
        names = [(p, q) for p, q in PARTS if q in getattr(glu, p)]
        tensors, row_bytes, files, offsets = [], [], [], []
        experts = getattr(glu, names[0][0])[names[0][1]].shape[0]
        for proj, part in names:
            full = getattr(glu, proj)[part]
            tensors.append(mx.zeros((slots, *full.shape[1:]), dtype=full.dtype))
            row_bytes.append(full.nbytes // experts)
        mx.eval(tensors)
        for e in range(experts):
            for (proj, part), rb in zip(names, row_bytes):
                info = index.tensors[f"{prefix}.{proj}.{part}"]
                files.append(info.file)
                offsets.append(info.start + e * rb)
        for (proj, part), t in zip(names, tensors):  # the stock tensors go: the slot rows are all it holds
            getattr(glu, proj)[part] = t
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "slot_tensors", tensors)
        object.__setattr__(self, "table", _resolve_misses.LayerSlots(layer, experts, slots, row_bytes, files,
                                                                     offsets, [str(f) for f in index.files]))

    def __call__(self, x, indices):
        slots, *tensors = _resolve_misses.resolve(indices.astype(mx.uint32), self.slot_tensors, self.table)
        for (proj, part), t in zip(self.names, tensors):
            getattr(self.glu, proj)[part] = t
        return self.glu(x, slots)


def resolved_model(ck: Path, slots: int):
    model, _ = load_model(ck)
    index = CheckpointIndex(ck)
    switches = []
    for i, layer in enumerate(model.layers):
        glu = getattr(layer.mlp, "switch_mlp", None)
        if glu is None:
            continue
        layer.mlp.switch_mlp = ResolvedSwitch(glu, f"model.layers.{i}.mlp.switch_mlp", i, slots, index)
        switches.append(layer.mlp.switch_mlp)
    mx.clear_cache()
    return model, switches


def decode(model, tokens: list[int]):
    """Teacher-forced, mlx-lm's loop shape. Returns (logits per step, ms a token, build ms, wait ms)."""
    cache = make_prompt_cache(model)
    step = lambda t: model(mx.array([[t]]), cache=cache)[0, -1]  # noqa: E731
    outs, build, wait = [], 0.0, 0.0
    t0 = time.perf_counter()
    y = step(tokens[0])
    mx.async_eval(y)
    for t in tokens[1:]:
        b0 = time.perf_counter()
        nxt = step(t)
        mx.async_eval(nxt)
        b1 = time.perf_counter()
        outs.append(np.array(y.astype(mx.float32)))
        b2 = time.perf_counter()
        build += b1 - b0
        wait += b2 - b1
        y = nxt
    outs.append(np.array(y.astype(mx.float32)))
    n = len(tokens)
    return outs, 1e3 * (time.perf_counter() - t0) / n, 1e3 * build / (n - 1), 1e3 * wait / (n - 1)


def layer_call_cost(switch, hidden: int, k: int, calls: int = 200) -> tuple[float, int]:
    """Median host microseconds of building one resolved layer call (its evaluation, where any
    miss is read, outside the timing) and the Python-visible calls it makes, evaluation included."""
    from expert_stream.streaming.lab.layer_cost import count_calls

    rng = np.random.default_rng(0)
    x = mx.zeros((1, 1, hidden), dtype=mx.bfloat16)
    experts = len(switch.table.slot_of)
    routes = [mx.array(rng.choice(experts, k, replace=False).astype(np.uint32).reshape(1, 1, k)) for _ in range(16)]
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        y = switch(x, routes[i % len(routes)])
        times.append(time.perf_counter() - t0)
        mx.eval(y)
    return 1e6 * float(np.median(times)), count_calls(lambda: mx.eval(switch(x, routes[0])))


def engine_model(ck: Path, slots: int):
    import expert_stream
    from expert_stream.streaming.footprint import checkpoint_footprint

    fp = checkpoint_footprint(ck)
    model, _, handle = expert_stream.load(ck, budget_gib=fp.budget_gib_for_slots(slots), policy="lru",
                                          online_budget=False, prefetch=False)
    return model, handle


def fault(ck_copy: Path, model, switches, tokens: list[int]) -> dict:
    """Cut the first shard after its header, decode on until a miss reads there: the error, the slot."""
    index = CheckpointIndex(ck_copy)
    with open(index.files[0], "r+b") as f:
        f.truncate(min(t.start for t in index.tensors.values() if t.file == 0))
    cache = make_prompt_cache(model)
    error = None
    for t in tokens:
        try:
            mx.eval(model(mx.array([[t]]), cache=cache))
        except RuntimeError as exc:
            error = str(exc)
            break
    broken = [s for s in switches if s.table.failed]
    expert = int(re.search(r"reading expert (\d+)", error).group(1)) if error else None
    again = None
    if broken:
        try:
            mx.eval(broken[0](mx.zeros((1, 1, model.args.hidden_size), dtype=mx.bfloat16),
                              mx.zeros((1, 1, 1), dtype=mx.uint32)))
        except RuntimeError as exc:
            again = str(exc)
    return dict(error=error, layers_failed=len(broken), fails_again=again is not None,
                failed_expert_in_a_slot=bool(broken and broken[0].table.slot_of[expert] >= 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True, help="a text file, teacher-forced")
    ap.add_argument("--slots", type=int, default=12, help="slots a layer (12 of the fixture's 48 = 25%%)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokens = load_tokenizer(args.checkpoint).encode(args.text.read_text())[: args.tokens]
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "ck"
        shutil.copytree(args.checkpoint, ck)  # the fault cuts this copy
        stock, _ = load_model(ck)
        native, switches = resolved_model(ck, args.slots)
        engine, handle = engine_model(ck, args.slots)
        models = dict(stock=stock, engine=engine, native=native)
        for m in models.values():  # warm-up
            decode(m, tokens[:16])
        rows = {name: [] for name in models}
        reference = None
        for _ in range(args.rounds):
            for name, m in models.items():
                outs, ms, build, wait = decode(m, tokens)
                reference = outs if reference is None else reference
                equal = sum(np.array_equal(a, b) for a, b in zip(outs, reference))
                rows[name].append(dict(ms=ms, build_ms=build, wait_ms=wait, steps_equal=int(equal)))
        calls, hits, misses, nbytes = np.sum([s.table.stats for s in switches], axis=0)
        k = native.args.num_experts_per_tok
        layer_us, layer_calls = layer_call_cost(switches[0], native.args.hidden_size, k)
        handle.close()
        faulted = fault(ck, native, switches, tokens)
    stock_ms = min(r["ms"] for r in rows["stock"])
    print(f"{mx.default_device()}, {args.checkpoint.name}, {len(switches)} MoE layers, {args.slots} slots a layer, "
          f"{len(tokens)} tokens of {args.text.name} teacher-forced x {args.rounds} rounds (best round)")
    print(f"native: {misses / (calls / len(switches)):.2f} misses a token ({int(misses)} of "
          f"{int(hits + misses)} expert uses), {nbytes / 1e6 / (calls / len(switches)):.2f} MB a token")
    print(f"one resolved layer call: {layer_us:.0f} us of host work to build, {layer_calls} Python-visible calls "
          f"(random top-{k} routes, most of them misses, read inside the evaluation)")
    print(f"{'variant':8} {'ms/token':>9} {'vs stock':>9} {'build ms':>9} {'wait ms':>8}  exact steps")
    for name in models:
        best = min(rows[name], key=lambda r: r["ms"])
        exact = min(r["steps_equal"] for r in rows[name])
        print(f"{name:8} {best['ms']:9.2f} {best['ms'] / stock_ms:9.2f} {best['build_ms']:9.2f} "
              f"{best['wait_ms']:8.2f}  {exact}/{len(tokens)}")
    print(f"fault: {faulted['error']}")
    print(f"  layers failed {faulted['layers_failed']}, fails again {faulted['fails_again']}, "
          f"the expert it was reading in a slot {faulted['failed_expert_in_a_slot']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows, fault=faulted,
                           layer_call=dict(us=layer_us, python_calls=layer_calls),
                           native=dict(calls=int(calls), hits=int(hits), misses=int(misses), bytes=int(nbytes))), f,
                      indent=1)


if __name__ == "__main__":
    main()
