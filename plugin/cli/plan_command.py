"""`expert-stream plan MODEL_DIR`: what a checkpoint needs, what `budget_gib: auto` would pick on
this machine and why, which budgets fit, and what they decode at.

It runs the load checks first (streaming/load_checks.py, as a load would). Sizes come from the
headers and a lazily built model (no weights read); the speed from a short measurement of the
disk's read bandwidth on the checkpoint's own shards, a timed decode with every expert resident
(plan_prediction.py) and a miss curve (a trace, or labelled assumptions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from expert_stream.streaming.auto_budget import HEADROOM_GIB
from expert_stream.streaming.errors import ExpertStreamError
from expert_stream.streaming.settings import DEFAULT_CONTEXT_LENGTH

GIB = 1 << 30


def register(sub) -> None:
    p = sub.add_parser("plan", help="what an MoE checkpoint needs and which budgets fit this machine")
    p.add_argument("model_dir", help="MLX checkpoint folder")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT_LENGTH,
                   help="tokens of KV cache to leave room for (the context_length setting)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="plan for this much memory (default: what this process may use: its cgroup limit, Metal's "
                        "working set, or physical memory)")
    p.add_argument("--headroom-gib", type=float, default=HEADROOM_GIB,
                   help="memory kept free beside the model (the config's headroom_gib)")
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="skip the disk measurement, use this GB/s")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="skip the compute measurement: ms per decode token with every expert resident")
    p.add_argument("--trace", default=None, metavar="TRACE.npz",
                   help="a routing trace of this model (expert-stream trace): miss rates from it instead of "
                        "the uniform-routing assumption")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="also show what each of N machines holds in mlx_lm.server's pipeline mode (layers, trunk, "
                        "experts, budgets per rank)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the Python file a config.json `model_file` names to run (refused otherwise)")
    p.set_defaults(func=run_plan)


def make_plan(model_dir: Path, context: int, memory_bytes: int, bandwidth_gbps: float,
              t_compute: float | None = None, trace: str | None = None, trust_remote_code: bool = False,
              headroom_gib: float = HEADROOM_GIB, memory_source: str = "--memory-gib") -> dict:
    """The plan of a checkpoint that passed the load checks (`run_plan` runs them first)."""
    from expert_stream.plugin import plugins
    from expert_stream.plugin.cli import plan_prediction
    from expert_stream.streaming.auto_budget import alone
    from expert_stream.streaming.footprint import checkpoint_footprint
    from expert_stream.streaming.memory_limit import MemoryLimit
    from expert_stream.streaming.settings import StreamSettings

    fp = checkpoint_footprint(model_dir, plugins.architectures(), trust_remote_code)
    limit = MemoryLimit(memory_bytes, memory_source)
    auto = alone(str(model_dir), fp, StreamSettings(context_length=context), limit, headroom_gib)
    kv = fp.kv.bytes_for(context)
    reserve = sum(t.bytes for t in auto.terms[2:])  # MLX cache and headroom
    room = auto.free
    row = fp.bytes_per_slot_row
    experts = max(fp.num_experts)
    top_k = fp.top_k or 1
    compute_source = "given" if t_compute is not None else None
    if t_compute is None and fp.expert_bytes <= plan_prediction.ALL_RESIDENT_MAX_BYTES \
            and fp.loaded_bytes + reserve <= memory_bytes:
        t_compute = plan_prediction.measure_compute(model_dir, experts * row / GIB * 1.0001, forced=False,
                                                       trust_remote_code=trust_remote_code)
        compute_source = "timed with every expert in a slot"
    elif t_compute is None and fp.trunk_bytes + fp.min_budget_bytes + reserve <= memory_bytes:
        t_compute = plan_prediction.measure_compute(model_dir, fp.min_budget_gib * 1.0001, forced=True,
                                                       trust_remote_code=trust_remote_code)
        compute_source = "timed with the smallest budget, every lookup forced to hit (errs slow)"
    all_slots = sorted(s for s in {top_k, 2 * top_k, experts // 8, experts // 4, experts // 2, experts}
                       if top_k <= s <= experts)
    from_trace = plan_prediction.trace_miss_rates(trace, [s / experts for s in all_slots]) if trace else None
    budgets = []
    for slots in all_slots:
        budget = slots * row
        if from_trace:
            miss_low, miss_high = from_trace[slots / experts]
            curve = "trace: default policy .. LRU"
        else:
            # Uniform routing (conservative): a token's expert is resident with p = slots / experts.
            miss_low, miss_high = 0.0, 1 - slots / experts
            curve = "assumed: repeating routing (compute only) .. uniform routing (conservative)"
        if t_compute is None:  # the trunk and the smallest budget do not fit: nothing to time
            slow = fast = 0.0
        else:
            slow, fast = plan_prediction.predict(t_compute, fp.token_expert_bytes, bandwidth_gbps, miss_low, miss_high)
        budgets.append({"slots_per_layer": slots, "budget_gib": round(budget / GIB, 4), "fits": budget <= room,
                        "miss_rate": [round(miss_low, 4), round(miss_high, 4)],
                        "miss_gb_per_token": round(miss_high * fp.token_expert_bytes / 1e9, 4),
                        "tok_s": [round(slow, 2), round(fast, 2)], "miss_curve": curve})
    return {
        "prefill": prefill_plan(fp, StreamSettings(context_length=context), reserve),
        "model_dir": str(model_dir), "model_type": fp.model_type,
        "total_gib": round(fp.total_bytes / GIB, 3), "trunk_gib": round(fp.trunk_bytes / GIB, 3),
        "expert_gib": round(fp.expert_bytes / GIB, 3), "dropped_gib": round(fp.dropped_bytes / GIB, 3),
        # exact bytes: trunk + experts is what stock loads; dropped is on disk only (MTP, vision)
        "total_bytes": fp.total_bytes, "trunk_bytes": fp.trunk_bytes, "expert_bytes": fp.expert_bytes,
        "dropped_bytes": fp.dropped_bytes, "moe_layers": len(fp.layer_expert_bytes),
        "experts_per_layer": experts, "top_k": fp.top_k,
        "token_expert_gib": round(fp.token_expert_bytes / GIB, 4), "min_budget_gib": round(fp.min_budget_gib, 4),
        "memory_gib": round(memory_bytes / GIB, 2), "memory_source": limit.source,
        "kv_cache_gib": round(kv / GIB, 3), "kv_source": fp.kv.source, "context": context,
        "reserve_gib": round(reserve / GIB, 3), "largest_budget_gib": round(max(room, 0) / GIB, 3),
        "auto": auto.as_dict() if auto.free >= auto.smallest else {"refused": auto.refusal()},
        "auto_lines": auto.lines(),
        "fits_stock": fp.loaded_bytes + kv + reserve <= memory_bytes,
        "disk_gbps": round(bandwidth_gbps, 3),
        "t_compute_ms": round(t_compute * 1e3, 3) if t_compute is not None else None,
        "t_compute_source": compute_source,
        "trace": str(trace) if trace else None, "budgets": budgets,
    }


def prefill_plan(fp, settings, reserve: int) -> dict:
    """What a layer-major prefill holds beside the trunk, the slots and the KV cache: its
    activations, per token and for a full pass; and the pass that auto's reserve (MLX cache and
    headroom) holds. Passes shrink at run time to the memory left (streaming/prompt_pass.py)."""
    from expert_stream.streaming.prompt_pass import PASS_MARGIN_BYTES, PER_CHUNK_FAMILIES, readahead_experts

    per, step = fp.prefill_token_bytes, settings.prefill_step
    window = min(settings.prefill_window, settings.context_length)
    fits = max(reserve - PASS_MARGIN_BYTES, 0) // per if per else window
    expert = max(fp.layer_expert_bytes, default=0)
    readahead = readahead_experts(int(settings.prefill_readahead_gib * GIB), expert, max(fp.num_experts, default=0))
    return {"token_bytes": per, "prefill_window": settings.prefill_window, "prefill_step": step,
            "pass_gib": round(per * window / GIB, 4), "chunk_gib": round(per * min(step, window) / GIB, 4),
            "auto_pass_tokens": min(window, max(step, fits // step * step)),
            "readahead_experts": readahead, "readahead_gib": round(readahead * expert / GIB, 4),
            "per_chunk": PER_CHUNK_FAMILIES.get(fp.model_type)}


def header(model_dir: Path) -> str:
    """The first line, from config.json and the shard headers alone (no mlx-lm import)."""
    from expert_stream.streaming.checkpoint import CheckpointIndex

    index = CheckpointIndex(model_dir)
    cfg = index.config.get("text_config") or index.config
    return (f"model:    {model_dir} ({index.model_type}, {cfg.get('num_hidden_layers', '?')} layers, "
            f"{index.total_bytes() / GIB:.3f} GiB on disk)")


def run_plan(args) -> int:
    from expert_stream.plugin.paths import resolve_model_path

    model_dir = Path(resolve_model_path(args.model_dir))  # `~`, $VARS, or a hub id in the local HF cache
    if not model_dir.is_dir():
        raise ExpertStreamError(f"{model_dir}: not a folder; plan needs a local MLX checkpoint")
    if not args.json:
        print(header(model_dir), flush=True)  # config.json and the headers alone: before mlx-lm is imported
    from expert_stream.plugin import plugins
    from expert_stream.streaming.load_checks import check_checkpoint
    from expert_stream.streaming.memory_limit import memory_limit
    from expert_stream.streaming.settings import StreamSettings

    settings = StreamSettings(context_length=args.context)  # budget_gib auto, as an entry without a number
    check_checkpoint(model_dir, settings, f"{model_dir}: expert_stream", plugins.load_hooks(), args.trust_remote_code)
    limit = memory_limit(int(args.memory_gib * GIB) if args.memory_gib else None, "--memory-gib")
    bandwidth = args.bandwidth_gbps
    if bandwidth is None:
        from expert_stream.streaming.checkpoint import CheckpointIndex
        from expert_stream.streaming.lab.disk_bandwidth import measure_read_bandwidth

        print("measuring the disk's read bandwidth on the shards ...", file=sys.stderr, flush=True)
        files = CheckpointIndex(model_dir).files
        total = min(256 << 20, sum(f.stat().st_size for f in files))
        bandwidth = measure_read_bandwidth(files, total_bytes=total,
                                           block_bytes=min(4 << 20, max(total // 16, 4096)))["gbps"]
    if args.compute_ms is None:
        print("timing decode steps with every expert resident ...", file=sys.stderr, flush=True)
    plan = make_plan(model_dir, args.context, limit.bytes, bandwidth,
                     t_compute=args.compute_ms / 1e3 if args.compute_ms is not None else None, trace=args.trace,
                     trust_remote_code=args.trust_remote_code, headroom_gib=args.headroom_gib,
                     memory_source=limit.source)
    if args.ranks is not None:
        from expert_stream.plugin.cli.plan_ranks import rank_plan

        plan["pipeline"] = rank_plan(model_dir, args.ranks, args.context, limit.bytes,
                                     int(plan["reserve_gib"] * GIB), args.trust_remote_code)
    if args.json:
        json.dump(plan, sys.stdout, indent=2)
        print()
        return 0
    print(f"layout:   {plan['model_type']}, {plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts, "
          f"top-{plan['top_k']}")
    dropped = f" + {plan['dropped_gib']} GiB stock drops at load (MTP, vision)" if plan["dropped_bytes"] else ""
    print(f"size:     {plan['total_gib']} GiB = trunk {plan['trunk_gib']} GiB + experts {plan['expert_gib']} GiB"
          f"{dropped}")
    print(f"memory:   {plan['memory_gib']} GiB ({plan['memory_source']}); KV cache for {plan['context']} tokens "
          f"{plan['kv_cache_gib']} GiB ({plan['kv_source']}); MLX cache and headroom {plan['reserve_gib']} GiB")
    print(f"stock:    {'fits' if plan['fits_stock'] else 'does not fit'} in memory")
    print(f"budget:   smallest {plan['min_budget_gib']} GiB, largest that fits {plan['largest_budget_gib']} GiB")
    if "refused" in plan["auto"]:
        print(f"auto:     refused: {plan['auto']['refused']}")
    else:
        print(f"auto:     budget_gib auto picks {plan['auto']['budget_gib']} GiB here:")
    for line in plan["auto_lines"]:
        print(f"            {line}")
    pre = plan["prefill"]
    if pre["per_chunk"]:
        print(f"prefill:  chunk by chunk ({pre['prefill_step']} tokens, each chunk one sweep): {pre['per_chunk']}")
    else:
        print(f"prefill:  layer-major, passes of up to {min(pre['prefill_window'], plan['context'])} tokens "
              f"(prefill_window): activations {pre['token_bytes'] / 1024:.1f} KiB a token, {pre['pass_gib']} GiB "
              f"a full pass (stock's one {pre['prefill_step']}-token chunk: {pre['chunk_gib']} GiB); beside auto's "
              f"budget, its MLX cache and headroom hold passes of about {pre['auto_pass_tokens']} tokens; passes "
              "shrink to the memory left, down to one chunk")
        print(f"          reads ahead up to {pre['readahead_experts']} experts a layer as each chunk's routing "
              f"arrives ({pre['readahead_gib']} GiB of host rows, prefill_readahead_gib; fewer where memory is short)")
    print(f"disk:     {plan['disk_gbps']} GB/s measured")
    if plan["t_compute_ms"] is None:
        print("compute:  not measured: the trunk and the smallest budget do not fit in memory")
    else:
        print(f"compute:  {plan['t_compute_ms']} ms per token with every expert resident "
              f"({plan['t_compute_source']})")
    print(f"decode tok/s by budget; miss rates {plan['budgets'][0]['miss_curve']}:")
    for b in plan["budgets"]:
        print(f"  {b['budget_gib']:>10} GiB  {b['slots_per_layer']:>4} slots/layer  "
              f"{'fits' if b['fits'] else 'too big':>7}  miss {b['miss_rate'][0]:.1%}-{b['miss_rate'][1]:.1%}  "
              f"-> {b['tok_s'][0]}-{b['tok_s'][1]} tok/s")
    if "pipeline" in plan:
        from expert_stream.plugin.cli.plan_ranks import print_rank_plan

        print_rank_plan(plan["pipeline"])
    return 0
