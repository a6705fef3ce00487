"""`expert-stream synth`: write a random-weight MoE checkpoint of an mlx-lm architecture, laid
out as a converted mlx-community model (for tests, demos and benchmarks, e.g. one larger than
this machine's memory with --target-gb)."""

from __future__ import annotations

import json
import time

GB = 1e9


def register(sub) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic (random-weight) MoE checkpoint",
        description="Write a random-weight MoE checkpoint that stock mlx_lm.load loads. Sizes "
        "default to a tiny model of the architecture; --target-gb picks the layer count.",
    )
    # not argparse choices: listing them would import mlx-lm's models for every `--help`
    p.add_argument("--arch", default="qwen3_moe",
                   help="mlx-lm model_type: qwen3_moe (default), qwen3_next, qwen3_5_moe, "
                   "deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, nemotron_h, kimi_linear, "
                   "minimax, laguna (mlx-lm >= 0.32), ...")
    p.add_argument("--out", required=True, help="output folder (reused if it already holds the same checkpoint)")
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, help="experts per token")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--moe-hidden", "--expert-intermediate", dest="moe_hidden", type=int,
                   help="intermediate size of one expert")
    p.add_argument("--moe-layers", type=int, help="number of MoE layers (the layer count follows)")
    p.add_argument("--like-trace", metavar="TRACE.npz",
                   help="shape it like a routing trace: its MoE layers, experts and top-k, with the expert "
                   "sizes of the real model of that routing (Qwen1.5-MoE for 60 experts top-4, ...); "
                   "the size flags override any of them")
    p.add_argument("--bits", help="affine bits (2-8), 0 for unquantized, or mxfp4 "
                   "(default: 4-bit affine; mxfp4 for gpt_oss; 2-bit for prism_hadamard_qwen35, which takes no other)")
    p.add_argument("--no-quantize", action="store_true", help="same as --bits 0")
    p.add_argument("--group-size", type=int, help="quantization group size (default 64; 32 for mxfp4; 128 for prism_hadamard_qwen35)")
    p.add_argument("--mixed-bits", help="expert blocks of some layers at other bits: "
                   "LAYER:BITS,... (e.g. 0:8,2:8) or one width B for every odd layer")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the unquantized tensors (default bfloat16, as real exports)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, help="tokenizer and embedding size (default 1024)")
    p.add_argument("--shard-size-mb", type=int, default=2048)
    p.add_argument("--vlm-layout", action="store_true",
                   help="mlx-vlm text-export layout (language_model. names) where stock mlx-lm loads it")
    p.add_argument("--target-gb", type=float,
                   help="pick the layer count so the checkpoint holds at least this many GB")
    p.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                   help="set a config field, e.g. --override num_attention_heads=32 (repeatable)")
    p.add_argument("--draft-for", metavar="MODEL_DIR",
                   help="instead: a draft model for speculative decoding with MODEL_DIR's tokenizer, a random dense "
                   "qwen3 of --layers (default 2) and --hidden (default 128)")
    p.add_argument("--early-exit", action="store_true",
                   help="with --draft-for: the draft is MODEL_DIR's own first --layers layers, head and norm")
    p.add_argument("--dry-run", action="store_true", help="print the sizes without writing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_synth)


def _overrides(items: list[str]) -> dict:
    from expert_stream.streaming.lab.synthetic.errors import SyntheticError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SyntheticError(f"--override {item!r}: expected KEY=JSON, e.g. head_dim=128")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value  # a bare string
    return out


def run_synth(args) -> int:
    from expert_stream.streaming.lab.synthetic import (
        estimate_size,
        layers_for_target,
        make_checkpoint,
    )
    from expert_stream.streaming.lab.synthetic.errors import SyntheticError

    if args.draft_for or args.early_exit:
        return _draft(args)
    kwargs = dict(
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        moe_hidden=args.moe_hidden,
        bits=0 if args.no_quantize else args.bits,
        group_size=args.group_size,
        mixed_bits=args.mixed_bits,
        dtype=args.dtype,
        seed=args.seed,
        vocab_size=args.vocab_size,
        shard_size_mb=args.shard_size_mb,
        vlm_layout=args.vlm_layout,
        overrides=_overrides(args.override),
    )
    like = _like_trace(args, kwargs) if args.like_trace else None
    if args.moe_layers is not None or like:
        if args.layers is not None or args.target_gb is not None:
            raise SyntheticError("--moe-layers and --like-trace set the layer count: give neither --layers nor --target-gb")
        from expert_stream.streaming.lab.synthetic.like_trace import layers_for_moe_layers

        kwargs["layers"] = layers_for_moe_layers(args.arch, like["moe_layers"] if like else args.moe_layers, **kwargs)
    if args.target_gb is not None:
        if args.layers is not None:
            raise SyntheticError("give --layers or --target-gb, not both")
        kwargs["layers"] = layers_for_target(args.arch, int(args.target_gb * GB), **kwargs)
    sizes = estimate_size(args.arch, **kwargs)
    path = None
    seconds = 0.0
    if not args.dry_run:
        t0 = time.perf_counter()
        path = make_checkpoint(args.out, args.arch, progress=not args.json, **kwargs)
        seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"path": str(path) if path else None, "arch": args.arch,
                          "seconds": round(seconds, 2), **sizes, "like_trace": like}, indent=2))
        return 0
    print(f"checkpoint: {path if path else '(dry run, nothing written)'}")
    if like:
        print(f"like:       {like['trace']}: {like['moe_layers']} MoE layers, {like['experts']} experts top-{like['top_k']}, "
              f"hidden {like['hidden']}, expert intermediate {like['moe_hidden']}"
              + (f" (expert sizes of {like['family']})" if like["sizes_from"] == "family"
                 else f" (routing of {like['family'] or 'an unknown model'}; sizes from the flags)"))
    print(f"arch:       {args.arch}, {sizes['layers']} layers, {sizes['moe_layers']} MoE layers "
          f"x {sizes['experts']} experts")
    print(f"total:      {_size(sizes['total_bytes'])} in {sizes['n_shards']} shard(s)")
    print(f"experts:    {_size(sizes['expert_bytes'])} "
          f"({_size(sizes['bytes_per_expert'])} per expert per layer)")
    print(f"trunk:      {_size(sizes['trunk_bytes'])}")
    if sizes["mtp_bytes"]:
        print(f"MTP head:   {_size(sizes['mtp_bytes'])} in {sizes['mtp_tensors']} tensors (stock drops it at load)")
    if path:
        print(f"written in: {seconds:.1f} s")
    return 0


def _draft(args) -> int:
    from expert_stream.streaming.lab.synthetic.draft import make_dense_draft, make_truncated_draft
    from expert_stream.streaming.lab.synthetic.errors import SyntheticError

    if not args.draft_for:
        raise SyntheticError("--early-exit makes a draft: give --draft-for MODEL_DIR")
    if args.early_exit:
        if args.layers is None:
            raise SyntheticError("--early-exit: give --layers, the main model's layers the draft keeps")
        path = make_truncated_draft(args.draft_for, args.out, args.layers)
    else:
        path = make_dense_draft(args.draft_for, args.out, layers=args.layers or 2, hidden=args.hidden or 128,
                                seed=args.seed)
    if args.json:
        print(json.dumps({"path": str(path), "draft_for": args.draft_for, "early_exit": args.early_exit}))
    else:
        print(f"draft: {path} ({'early exit of' if args.early_exit else 'dense, random weights, tokenizer of'} "
              f"{args.draft_for})")
    return 0


def _like_trace(args, kwargs: dict) -> dict:
    """The trace's shape (flags win), written into kwargs; returned for the report."""
    from expert_stream.streaming.lab.synthetic.like_trace import like_trace_shape
    from expert_stream.streaming.traces import load_trace

    trace = load_trace(args.like_trace)
    shape = like_trace_shape(trace, moe_layers=args.moe_layers, experts=args.experts, top_k=args.top_k,
                             hidden=args.hidden, expert_intermediate=args.moe_hidden)
    kwargs.update(experts=shape["experts"], top_k=shape["top_k"], hidden=shape["hidden"], moe_hidden=shape["moe_hidden"])
    return {"trace": trace.name, **shape}


def _size(n: int) -> str:
    return f"{n / GB:.3f} GB" if n >= 0.1 * GB else f"{n / 1e6:.3f} MB"
