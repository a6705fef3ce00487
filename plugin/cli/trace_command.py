"""`expert-stream trace`: record routing on a text corpus into a trace file, for warm start
(`warm_start`) and per-layer budgets (`budget_by_trace`)."""

from __future__ import annotations

import sys
from pathlib import Path

from expert_stream.streaming.settings import budget_from_text


def register(sub) -> None:
    t = sub.add_parser("trace", help="record routing on a text corpus into a trace file")
    t.add_argument("model_dir")
    t.add_argument("--out", required=True, help="trace file to write (.npz, the shared trace format)")
    t.add_argument("--budget-gib", type=budget_from_text, default="auto",
                   help="GiB of expert slots, or auto (the default: fit to memory)")
    t.add_argument("--corpus", default=None, help="text file; documents separated by blank lines "
                   "(default: the project's embedded English text)")
    t.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens generated after each document")
    t.add_argument("--max-docs", type=int, default=64)
    t.set_defaults(func=run_trace_command)


def run_trace_command(args) -> int:
    from mlx_lm.generate import generate_step
    from tqdm import tqdm

    import expert_stream
    from expert_stream.streaming.traces import save_trace

    if args.corpus:
        text = Path(args.corpus).read_text()
    else:
        from expert_stream.streaming.lab.synthetic.corpus import CORPUS as text
    docs = [d.strip() for d in text.split("\n\n") if d.strip()][: args.max_docs]
    model, tokenizer, handle = expert_stream.load(args.model_dir, budget_gib=args.budget_gib)
    with handle.recording() as recorder:
        for doc in tqdm(docs, desc="trace", file=sys.stderr):
            prompt = __import__("mlx.core", fromlist=["array"]).array(tokenizer.encode(doc))
            for _ in generate_step(prompt, model, max_tokens=args.gen_tokens):
                pass
            recorder.new_sequence()
    trace = recorder.trace(name=Path(args.out).stem, meta={"model_dir": str(args.model_dir), "documents": len(docs)})
    path = save_trace(args.out, trace)
    handle.close()
    print(f"{path}: {trace.num_tokens} tokens x {trace.num_layers} layers x top-{trace.top_k}")
    return 0
