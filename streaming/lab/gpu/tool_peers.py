"""`gpu_tool.py peers`: published MoE expert-streaming peers (bigrig 0.9.1, boyle 0.2.1) and
stock mlx-lm on the same checkpoint, budget, memory cap and replayed trace as this project's
`expert-stream bench`, each in a fresh process (peer_child.py), one row each."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tool_bench
from tool_common import add_cap_args, add_checkpoint_args, budget_for_share, cap_for, checkpoint_here, table, write_outputs

HERE = Path(__file__).resolve().parent
PEERS = ("expert-stream", "bigrig", "boyle", "mlxlm")


def register(sub) -> None:
    p = sub.add_parser("peers", help="bigrig, boyle and stock mlx-lm beside expert-stream at one budget",
                       description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output folder (peers.json, peers.txt, runs/)")
    add_checkpoint_args(p)
    p.add_argument("--share", default="0.25",
                   help="share of each layer's experts the budget pays for, or 'full' (default 0.25)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list from {','.join(PEERS)}")
    add_cap_args(p, "every contestant but mlxlm")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--disk-gb", type=float, default=1.0, help="expert-stream bench --disk-gb (its row only)")
    p.add_argument("--trace-start", type=int, default=None, help="trace row of the first prompt token "
                   "(default: the bench's, the timed decode at the trace's first decode row)")
    p.add_argument("--own-routing", action="store_true",
                   help="run a peer whose expert calls the replay cannot cover on its own (random) routing, "
                   "marked in its row (default: the row says it cannot run under the trace)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per contestant")
    p.add_argument("--prefill-step", type=int, default=2048, help="prefill_step_size for every peer (ours: 2048)")
    p.add_argument("--prefetch", choices=("default", "on", "off"), default="default",
                   help="bigrig's next-layer staging (BIGRIG_STAGE); boyle has none")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of every peer child")
    p.add_argument("--wheels-dir", default=str(HERE / "wheels"),
                   help="the peers' wheels, used as zips when the peers are not installed (default streaming/lab/gpu/wheels)")
    p.add_argument("--bigrig-full-layers", default="auto",
                   help="auto (bigrig's own split of the same slot total into whole layers and the rest), off, or N")
    p.add_argument("--bigrig-io", choices=("mapped", "read", "nocache"), default="mapped",
                   help="mapped: bigrig's default (page-cache views); read: BIGRIG_MMAP=0; nocache: its F_NOCACHE "
                   "path, emulated with fadvise on Linux")
    p.add_argument("--bigrig-threads", type=int, default=8)
    p.add_argument("--boyle-io", choices=("direct", "fadvise", "cached", "mmap", "native"), default="direct",
                   help="direct: O_DIRECT reads (its F_NOCACHE on macOS bypasses the page cache too); native: "
                   "unpatched (fails on Linux)")
    p.add_argument("--boyle-io-workers", type=int, default=8)
    p.set_defaults(func=main, stock="no")


def _child_config(args, ck: Path, slots: int, peer: str, out: Path) -> dict:
    from expert_stream.streaming.lab.bench import replay_start
    from expert_stream.streaming.footprint import checkpoint_footprint
    from expert_stream.streaming.traces import load_trace

    fp = checkpoint_footprint(ck)
    cfg = json.loads((ck / "config.json").read_text())
    start = args.trace_start
    if args.trace is not None and start is None:
        start = replay_start(load_trace(args.trace), args.prompt_tokens)
    return {
        "peer": peer, "model_dir": str(ck), "model_type": fp.model_type, "n_experts": max(fp.num_experts),
        "top_k": fp.top_k, "moe_layers": len(fp.num_experts), "slots": slots,
        "vocab_size": int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]),
        "trace": str(args.trace) if args.trace else None, "trace_start": start or 0, "own_routing": args.own_routing,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "prefill_step": args.prefill_step,
        "prefetch": args.prefetch, "env": args.env, "wheels_dir": args.wheels_dir,
        "bigrig_home": tempfile.mkdtemp(prefix="gpu-tool-bigrig-"), "bigrig_full_layers": args.bigrig_full_layers,
        "bigrig_io": args.bigrig_io, "bigrig_threads": args.bigrig_threads, "boyle_io": args.boyle_io,
        "boyle_io_workers": args.boyle_io_workers,
        "result_path": str(out / f"{peer}.result.json"), "log_path": str(out / f"{peer}.log"),
    }


def run_peer(args, ck: Path, budget: float, slots: int, peer: str) -> dict:
    from expert_stream.streaming.lab.memory_cap import run_capped
    from expert_stream.streaming.settings import GIB

    out = args.out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    cfg = _child_config(args, ck, slots, peer, out)
    Path(cfg["result_path"]).unlink(missing_ok=True)
    # mlxlm is the everything-resident reference: uncapped, as in expert-stream bench.
    cap, cap_note = (None, "no cap (the everything-resident reference)") if peer == "mlxlm" else cap_for(budget, args)
    # `timeout` answers 124 when the time is up, which a kill under the cap (137) cannot be.
    argv = ["timeout", "-k", "10", str(args.timeout), sys.executable, str(HERE / "peer_child.py"), json.dumps(cfg)]
    t0 = time.perf_counter()
    killed, peak = False, None
    if cap is not None:
        done = run_capped(argv, int(cap * GIB), name="gpu-tool-peer")
        rc, killed = done.returncode, done.killed
        peak = done.peak_bytes / GIB if done.peak_bytes is not None else None
    else:
        rc = subprocess.run(argv, stdout=subprocess.DEVNULL).returncode
    try:
        r = json.loads(Path(cfg["result_path"]).read_text())
    except (OSError, json.JSONDecodeError):
        why = ("timed out after %ss" % args.timeout if rc == 124 else
               f"killed under the {cap} GiB cap" if killed else f"process died (rc {rc})")
        r = {"peer": peer, "ok": False, "error": why, "notes": []}
    r.update(budget_gib=budget, slots=slots, cap_gib=cap, cap=cap_note, cap_peak_gib=peak, rc=rc,
             wall_s=round(time.perf_counter() - t0, 1))
    return r


def ours(args, ck: Path, run: str) -> dict:
    """expert-stream's row: the bench subcommand's run, in the same shape as a peer's."""
    b = tool_bench.one_run(args, ck, run, ("default", {}, {}))
    ok = "decode_tok_s" in b
    return {"peer": "expert-stream", "ok": ok, "error": None if ok else b.get("killed_under_cap") or b.get("error"),
            "routing": "replayed trace" if b.get("routing") else "own (random router)",
            "run": {k: b.get(k) for k in ("decode_tok_s", "prefill_tok_s")} if ok else None,
            "stats_decode": {"misses_per_token": b.get("misses_per_token")}, "peak_rss_gb": b.get("peak_rss_gb"),
            "notes": [], "budget_gib": b["budget_gib"], "slots": b["slots_target"], "cap_gib": b["cap_gib"],
            "cap_peak_gib": (b.get("memory_cap") or {}).get("peak_gb") and b["memory_cap"]["peak_gb"] * 1e9 / 2**30,
            "cap": b["cap"], "rc": b["rc"], "wall_s": b["wall_s"], "bench_report": b}


def main(args) -> int:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        sys.exit(f"--peers: unknown {unknown}; choose from {', '.join(PEERS)}")
    ck = checkpoint_here(args, args.out)
    budget, slots = budget_for_share(ck, 1.0 if args.share == "full" else float(args.share))
    rows = []
    for peer in peers:
        rows.append(ours(args, ck, args.share) if peer == "expert-stream" else run_peer(args, ck, budget, slots, peer))
        print(f"peers {peer}: {'ok' if rows[-1]['ok'] else rows[-1]['error']}, {rows[-1]['wall_s']} s", flush=True)
        write_outputs(args.out, "peers", {"checkpoint": str(ck), "budget_gib": budget, "slots_per_layer": slots,
                                          "rows": rows, "partial": True}, "", echo=False)
    ref = next((r for r in rows if r["peer"] == "mlxlm" and r["ok"]), None)
    for r in rows:
        if ref is not None and r.get("tokens") is not None and r["peer"] != "mlxlm":
            r["tokens_match_mlxlm"] = r["tokens"] == ref["tokens"] and r["routing"] == ref["routing"]
        r.pop("tokens", None)
    text = (f"checkpoint {ck}; budget {budget} GiB = {slots} slots per layer; trace {args.trace or 'none'}; "
            f"{args.prompt_tokens} prompt + {args.gen_tokens} generated tokens\n"
            + table(["peer", "decode tok/s", "prefill tok/s", "miss/tok", "peak RSS GB", "cap GiB", "group peak GiB",
                     "routing", "result"],
                    [[r["peer"], (r.get("run") or {}).get("decode_tok_s"), (r.get("run") or {}).get("prefill_tok_s"),
                      (r.get("stats_decode") or {}).get("misses_per_token"), r.get("peak_rss_gb"),
                      r["cap_gib"] or "none", r.get("cap_peak_gib"), r.get("routing", "-"), "ok" if r["ok"] else r["error"][:140]]
                     for r in rows])
            + "".join(f"note ({r['peer']}): {n}\n" for r in rows for n in r.get("notes") or []))
    write_outputs(args.out, "peers", {"checkpoint": str(ck), "budget_gib": budget, "slots_per_layer": slots,
                                      "rows": rows}, text)
    return 0 if all(r["ok"] for r in rows) else 1
