# Usage (device): python3 tests/gpu/probe_rows.py
# Does a row's result from the stock expert projections depend on how many rows share the call?
# One stock SwitchGLU of a small synthetic qwen3_moe checkpoint, a 16-token chunk routed top-8
# (128 sorted rows, stock's path): the same rows recomputed in smaller calls (prefixes, the
# prefill sweep's expert batches), plain and padded with copies of their last row. A row that
# differs means the backend picks its kernel by row count, and the sweep must call it with as
# many rows as stock would for the bits to match.
import sys, tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from expert_stream.streaming.expert_calls import expert_rows  # noqa: E402
from expert_stream.streaming.synthetic import make_checkpoint  # noqa: E402

ck = make_checkpoint(Path(tempfile.mkdtemp()) / "q", arch="qwen3_moe", progress=False, layers=1, experts=64, top_k=8,
                     hidden=512, moe_hidden=256, dtype="bfloat16" if "gpu" in str(mx.default_device()) else "float32")
model, _ = load_model(Path(ck))
block = model.layers[0].mlp
glu, k = block.switch_mlp, block.top_k
rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((16, 512)).astype(np.float32)).astype(mx.bfloat16 if "gpu" in str(mx.default_device()) else mx.float32)
idx = mx.argpartition(-block.gate(x), kth=k - 1, axis=-1)[..., :k]
flat = np.array(idx).reshape(-1)
order = np.argsort(flat, kind="stable")
rows = mx.expand_dims(x, (-2, -3)).flatten(0, -3)


def run(pos, pad_to=0):
    """Rows `pos` (sorted by expert) in one call, padded with copies of the last row."""
    p = np.concatenate([pos, np.repeat(pos[-1:], max(0, pad_to - pos.size))])
    y = expert_rows(glu, rows[mx.array(p // k)], mx.array(flat[p].astype(np.uint32)), True)
    mx.eval(y)
    return y[: pos.size]


full = run(order)
print("device", mx.default_device(), "| full call again equal:", mx.array_equal(run(order), full).item())
for n in (1, 2, 4, 7, 8, 9, 16, 32, 64, 127):
    plain = mx.array_equal(run(order[:n]), full[:n]).item()
    padded = mx.array_equal(run(order[:n], pad_to=8), full[:n]).item()
    padded_full = mx.array_equal(run(order[:n], pad_to=order.size), full[:n]).item()
    print(f"first {n:3d} rows: alone {plain}, padded to 8 {padded}, padded to {order.size} {padded_full}")
experts = np.unique(flat)
for size in (8, 16):
    for pad in (0, 8, 16, 32, order.size):
        bad = 0
        for i in range(0, experts.size, size):
            sel = np.isin(flat[order], experts[i:i + size])
            bad += not mx.array_equal(run(order[sel], pad_to=pad), full[mx.array(np.flatnonzero(sel))]).item()
        print(f"sweep batches of {size} experts, padded to {pad}: {bad} of {-(-experts.size // size)} batches differ")
