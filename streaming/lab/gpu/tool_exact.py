"""`gpu_tool.py exact`: streamed against stock mlx-lm, every logit bitwise, on this machine's
default device, through the public API (`expert_stream.load`, tests/exactness.py). Stock
against itself runs first as the control: a backend that is not repeatable at a shape cannot
judge the engine there."""

from __future__ import annotations

import gc
import shlex
from pathlib import Path

from tool_common import CLI, parse_pairs, run_logged, table, write_outputs

# exact_gpu's shapes: big enough for the device's real kernels (bf16, hidden 512), small enough
# to make in seconds.
DEFAULT_SYNTH = "--layers 4 --hidden 512 --moe-hidden 256 --dtype bfloat16"


def register(sub) -> None:
    p = sub.add_parser("exact", help="streamed vs stock logits, bitwise, on this device", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output folder (exact.json, exact.txt)")
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="an existing checkpoint (repeatable); default: one synthetic checkpoint per --archs")
    p.add_argument("--archs", default="qwen3_moe,mixtral", help="architectures to synthesize without --checkpoint")
    p.add_argument("--synth", default=DEFAULT_SYNTH, metavar="'FLAGS'",
                   help=f"expert-stream synth flags for those (default: {DEFAULT_SYNTH!r})")
    p.add_argument("--slot-write", default="staged,cuda,copy",
                   help="comma list of slot_write settings to check (a value this backend refuses is "
                   "reported as not run)")
    p.add_argument("--slots", default="topk",
                   help="slots per layer: topk (constant eviction, default), all (every expert, no eviction), or N")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk (0: the whole prompt in one call)")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn from [3, VOCAB)")
    p.add_argument("--set", default="prefetch=false", metavar="K=V,...",
                   help="more streaming settings for every case (default prefetch=false)")
    p.set_defaults(func=main)


def _slots(spec: str, ck: Path) -> int | None:
    from expert_stream.streaming.footprint import checkpoint_footprint

    if spec == "topk":
        return None  # load_pair's default: top-k
    if spec == "all":
        return max(checkpoint_footprint(ck).num_experts)
    return int(spec)


def checkpoints(args) -> list[Path]:
    if args.checkpoint:
        return args.checkpoint
    out = []
    for arch in filter(None, args.archs.split(",")):
        ck = args.out / "checkpoints" / arch
        rc, _ = run_logged([*CLI, "synth", "--arch", arch, "--out", str(ck), *shlex.split(args.synth)],
                           args.out / f"synth-{arch}.log")
        if rc != 0:
            raise SystemExit(f"expert-stream synth --arch {arch} failed (rc {rc}); see {args.out}/synth-{arch}.log")
        out.append(ck)
    return out


def check(stock, streamed, args) -> str | None:
    """None when every logit matched, else what differed first."""
    from exactness import assert_same_logits, prompt_ids

    try:
        assert_same_logits(stock, streamed, prompt_ids(args.prompt_tokens, vocab=args.vocab),
                           decode_steps=args.decode_steps, chunk=args.chunk or None)
    except AssertionError as exc:
        return str(exc)
    return None


def main(args) -> int:
    import mlx.core as mx
    from exactness import load_pair
    from mlx_lm.utils import load_model

    from expert_stream.streaming.errors import ExpertStreamError
    from expert_stream.streaming.lab.setting_values import parse_value

    settings = {k: parse_value(v) for k, v in parse_pairs(args.set, "--set").items()}
    rows, failed = [], 0
    for ck in checkpoints(args):
        stock, _ = load_model(ck)
        bad = check(stock, stock, args)
        rows.append({"checkpoint": str(ck), "case": "stock vs stock (control)", "slots": "-",
                     "result": "exact" if bad is None else f"MISMATCH {bad} (the backend is not repeatable here)"})
        del stock
        for slot_write in filter(None, args.slot_write.split(",")):
            r = {"checkpoint": str(ck), "case": f"slot_write={slot_write}", "slots": args.slots}
            try:
                stock, streamed, handle = load_pair(ck, _slots(args.slots, ck), slot_write=slot_write, **settings)
            except (ExpertStreamError, RuntimeError, ValueError) as exc:
                rows.append({**r, "result": f"not run: {str(exc)[:200]}"})
                continue
            try:
                bad = check(stock, streamed, args)
                totals = handle.stats()["totals"]
                r.update(hits=totals["hits"], misses=totals["misses"], path=handle.decode_path[0],
                         result="exact" if bad is None else f"MISMATCH {bad}")
                failed += bad is not None
            except RuntimeError as exc:  # an MLX kernel missing for a shape: not the engine's to judge
                r["result"] = f"not run: {str(exc)[:200]}"
            finally:
                handle.close()
            rows.append(r)
            del stock, streamed, handle
            gc.collect()
            mx.clear_cache()
    head = (f"device {mx.default_device()}; prompt {args.prompt_tokens} tokens in chunks of "
            f"{args.chunk or args.prompt_tokens}, {args.decode_steps} greedy decode steps; settings {settings}\n")
    text = head + table(["checkpoint", "case", "slots", "path", "hits", "misses", "result"],
                        [[Path(r["checkpoint"]).name, r["case"], r["slots"], r.get("path"), r.get("hits"),
                          r.get("misses"), r["result"]] for r in rows])
    write_outputs(args.out, "exact", {"device": str(mx.default_device()), "cases": rows,
                                      "mismatches": failed}, text)
    return 1 if failed else 0
