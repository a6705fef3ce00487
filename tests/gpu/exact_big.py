# Usage (device): python3 tests/gpu/exact_big.py CHECKPOINT SLOTS [SLOT_WRITE]
# Bitwise logits at the benchmark's scale: a 512-token prompt in one prefill call, then 32
# greedy decode steps, SLOTS slots per layer; stock against itself first, as the control.
import sys
from pathlib import Path

from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exactness import assert_same_logits, load_pair, prompt_ids  # noqa: E402

ck, slots = Path(sys.argv[1]), int(sys.argv[2])
slot_write = sys.argv[3] if len(sys.argv) > 3 else "auto"
prompt = prompt_ids(512, vocab=1000, seed=1)
stock, _ = load_model(ck)
try:
    assert_same_logits(stock, stock, prompt, decode_steps=32)
    print("stock against itself: exact")
except AssertionError as exc:
    print(f"stock against itself: MISMATCH {exc}")
del stock
stock, streamed, handle = load_pair(ck, slots, slot_write=slot_write)
try:
    assert_same_logits(stock, streamed, prompt, decode_steps=32)
    print(f"streamed, {slots} slots, {slot_write}: exact; {handle.stats()['speculation']}")
except AssertionError as exc:
    print(f"streamed, {slots} slots, {slot_write}: MISMATCH {exc}")
handle.close()
