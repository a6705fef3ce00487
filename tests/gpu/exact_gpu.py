# Usage (device): [NARCH=1] [SLOTS=all] python3 tests/gpu/exact_gpu.py [SLOT_WRITE ...]
# Bitwise logits against stock on CUDA, for each slot write (staged, cuda, copy), with and
# without speculative decode (forced on every step): small synthetic checkpoints, slots = top-k
# (constant eviction), chunked prefill then greedy decode; first stock against itself, as a
# control. SLOTS=all gives every expert a slot (no eviction, no prefill sweep: each call runs
# whole, as stock's does). Prints one line per case (a mismatch also says how many slot rows differ from the
# checkpoint); exit status 1 on a mismatch.
import os, sys, tempfile
from pathlib import Path

import numpy as np
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exactness import assert_same_logits, load_pair, prompt_ids  # noqa: E402
from expert_stream.streaming.footprint import checkpoint_footprint  # noqa: E402
from expert_stream.streaming.synthetic import make_checkpoint  # noqa: E402

SLOT_WRITES = sys.argv[1:] or ["staged", "cuda", "copy"]
ARCHS = ("qwen3_moe", "mixtral")[:int(os.environ.get("NARCH", 2))]
root = Path(tempfile.mkdtemp())


def slot_check(stock, handle):
    """Do kernels see in each resident slot the bytes of its expert?"""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    weights = dict(tree_flatten(stock.parameters()))
    bad = total = 0
    for s in handle.streams:
        for e in np.flatnonzero(s.cache.slot_of >= 0):
            for leaf, arr in s.slots.arrays.items():
                total += 1
                bad += not mx.array_equal(arr[int(s.cache.slot_of[e])], weights[f"{s.name}.{leaf}"][int(e)]).item()
    return f"slot rows that differ from the checkpoint: {bad} of {total}"
failed = 0
for arch in ARCHS:
    ck = make_checkpoint(root / arch, arch=arch, progress=False, layers=4, hidden=512, moe_hidden=256, dtype="bfloat16")
    # Control: is stock itself repeatable bit for bit at these shapes on this backend?
    stock, _ = load_model(Path(ck))
    try:
        assert_same_logits(stock, stock, prompt_ids(40), decode_steps=24, chunk=16)
        print(f"{arch} stock against itself: exact")
    except AssertionError as exc:
        print(f"{arch} stock against itself: MISMATCH {exc} (the backend is not repeatable here)")
    for slot_write in SLOT_WRITES:
        for speculate in (True, False):
            slots = max(checkpoint_footprint(ck).num_experts) if os.environ.get("SLOTS") == "all" else None
            stock, streamed, handle = load_pair(ck, slots, slot_write=slot_write, speculate=speculate, prefetch=False)
            if handle.speculation is not None:
                handle.speculation.adaptive = False  # speculate every step, however it pays
            try:
                assert_same_logits(stock, streamed, prompt_ids(40), decode_steps=24, chunk=16)
                st = handle.stats()
                print(f"{arch} {slot_write} speculate={speculate}: exact; misses {st['totals']['misses']}, "
                      f"speculation {st['speculation']}")
            except AssertionError as exc:
                failed += 1
                print(f"{arch} {slot_write} speculate={speculate}: MISMATCH {exc}; {slot_check(stock, handle)}")
            except RuntimeError as exc:  # an MLX kernel missing for a shape: not ours to judge
                print(f"{arch} {slot_write} speculate={speculate}: not run: {str(exc)[:160]}")
            handle.close()
sys.exit(1 if failed else 0)
