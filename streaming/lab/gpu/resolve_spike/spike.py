"""Issue 31, stage 2 spike: what a host-resolved slot lookup between router and expert gather
costs a decode token, against stock's layer, and whether the Python thread waits for the device.

A token of `--layers` MoE layers shaped like the checkpoint under test (router, top-k, stock
mlx-lm SwitchGLU on 4-bit experts, every expert in a slot: lookup only), decoded as mlx-lm does
(the next token's graph built while the device runs this one). Per token, each way of turning
the router's expert ids into slots:

  stock        the ids themselves (the model with every expert resident)
  take         a slot table on the device (mx.take)
  readback     the ids brought to the host, looked up there, sent back (today's decode path)
  host_lookup  the primitive of host_lookup.cpp: the device waits for a host function, the
               Python thread does not wait at all

Prints ms a token, the Python thread's ms building a token and its ms waiting, against stock,
and checks every variant's output bitwise against stock's. Run from the repository root after
build.sh, with the built module importable (PYTHONPATH=its folder).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU

import _host_lookup


def make_layers(args):
    """`args.distinct` distinct layers (cycled to `args.layers`): router, experts, and the same
    experts in a permuted slot order with its expert -> slot table."""
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.distinct):
        glu = SwitchGLU(args.hidden, args.moe_hidden, args.experts)
        glu.set_dtype(mx.bfloat16)
        nn.quantize(glu, group_size=64, bits=4)
        expert_in = rng.permutation(args.experts)  # expert held by each slot
        slot_of = np.argsort(expert_in).astype(np.uint32)
        in_slots = SwitchGLU(args.hidden, args.moe_hidden, args.experts)
        in_slots.set_dtype(mx.bfloat16)
        nn.quantize(in_slots, group_size=64, bits=4)
        order = mx.array(expert_in)
        in_slots.update(tree_map(lambda a: a[order], glu.parameters()))
        router = (mx.random.normal((args.experts, args.hidden)) * args.hidden ** -0.5).astype(mx.bfloat16)
        mx.eval(glu.parameters(), in_slots.parameters(), router)
        sets.append(dict(glu=glu, in_slots=in_slots, router=router, slot_of=slot_of,
                         device_table=mx.array(slot_of), host_table=_host_lookup.SlotTable(slot_of.tolist())))
    return [sets[i % len(sets)] for i in range(args.layers)]


def token(layers, x, variant, k):
    for layer in layers:
        scores = mx.softmax((x @ layer["router"].T).astype(mx.float32), axis=-1)
        ids = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(scores, ids, axis=-1).astype(x.dtype)
        if variant == "stock":
            y = layer["glu"](x, ids)
        else:
            if variant == "take":
                slots = layer["device_table"][ids]
            elif variant == "readback":
                slots = mx.array(layer["slot_of"][np.array(ids)])
            else:
                slots = _host_lookup.host_lookup(ids.astype(mx.uint32), layer["host_table"])
            y = layer["in_slots"](x, slots)
        x = x + (y * weights[..., None]).sum(axis=-2)
        x = x * mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True)).astype(x.dtype)
    return x


def decode(layers, variant, steps, k, hidden):
    """mlx-lm's loop shape: build token t+1 on token t's unevaluated output, async_eval it, then
    wait for token t. Returns (outputs, ms a token, build ms a token, wait ms a token)."""
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(1)).astype(mx.bfloat16)
    mx.eval(x)
    outs, build, wait = [], 0.0, 0.0
    t0 = time.perf_counter()
    y = token(layers, x, variant, k)
    mx.async_eval(y)
    for _ in range(steps):
        b0 = time.perf_counter()
        nxt = token(layers, y, variant, k)
        mx.async_eval(nxt)
        b1 = time.perf_counter()
        mx.eval(y)
        b2 = time.perf_counter()
        build += b1 - b0
        wait += b2 - b1
        outs.append(y)
        y = nxt
    mx.eval(y)
    total = time.perf_counter() - t0
    return outs, 1e3 * total / (steps + 1), 1e3 * build / steps, 1e3 * wait / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--distinct", type=int, default=4, help="distinct layers' weights, cycled")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=60)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layers = make_layers(args)
    variants = ["stock", "take", "readback", "host_lookup"]
    for v in variants:  # warm-up: compile every kernel of every variant
        decode(layers, v, 4, args.top_k, args.hidden)
    rows = {v: [] for v in variants}
    reference = None
    for r in range(args.rounds):
        for v in variants:
            outs, ms, build, wait = decode(layers, v, args.steps, args.top_k, args.hidden)
            if v == "stock" and reference is None:
                reference = outs
            exact = all(mx.array_equal(a, b).item() for a, b in zip(outs, reference))
            rows[v].append(dict(ms=ms, build_ms=build, wait_ms=wait, exact=exact))
    stock_ms = min(r["ms"] for r in rows["stock"])
    print(f"device {mx.default_device()}, {args.layers} layers, hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.top_k}, {args.steps} tokens x {args.rounds} rounds (best round)")
    print(f"{'variant':12} {'ms/token':>9} {'vs stock':>9} {'per layer over stock us':>24} {'build ms':>9} {'wait ms':>8}  exact")
    for v in variants:
        best = min(rows[v], key=lambda r: r["ms"])
        over = 1e3 * (best["ms"] - stock_ms) / args.layers
        print(f"{v:12} {best['ms']:9.2f} {best['ms'] / stock_ms:9.2f} {over:24.1f} {best['build_ms']:9.2f} "
              f"{best['wait_ms']:8.2f}  {all(r['exact'] for r in rows[v])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
