"""`expert-stream plan MODEL_DIR`: what a checkpoint needs, and which budgets fit this machine.

Everything comes from the headers and a lazily built model (no weights read), plus one short
measurement of the disk's read bandwidth on the checkpoint's own shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from expert_stream.streaming.errors import ExpertStreamError

GIB = 1 << 30
# Memory left to the OS and the server process itself, beside trunk + budget + KV cache.
SYSTEM_RESERVE_GIB = 2.0


def register(sub) -> None:
    p = sub.add_parser("plan", help="what an MoE checkpoint needs and which budgets fit this machine")
    p.add_argument("model_dir", help="MLX checkpoint folder")
    p.add_argument("--context", type=int, default=32768, help="tokens of KV cache to leave room for")
    p.add_argument("--memory-gib", type=float, default=None, help="plan for this much memory (default: this machine)")
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="skip the disk measurement, use this GB/s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the Python file a config.json `model_file` names to run (refused otherwise)")
    p.set_defaults(func=run_plan)


def kv_bytes_per_token(config: dict) -> int:
    """Upper bound: full attention in every layer, bf16 keys and values."""
    cfg = config.get("text_config") or config
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads))
    return 2 * layers * kv_heads * head_dim * 2


def make_plan(model_dir: Path, context: int, memory_bytes: int, bandwidth_gbps: float) -> dict:
    from expert_stream.plugin import plugins
    from expert_stream.streaming.checkpoint import CheckpointIndex
    from expert_stream.streaming.footprint import checkpoint_footprint

    index = CheckpointIndex(model_dir)
    fp = checkpoint_footprint(model_dir, plugins.architectures())
    kv = kv_bytes_per_token(index.config) * context
    reserve = int(SYSTEM_RESERVE_GIB * GIB)
    room = memory_bytes - fp.trunk_bytes - kv - reserve
    row = fp.bytes_per_slot_row
    experts = max(fp.num_experts)
    budgets = []
    for slots in sorted({fp.top_k or 1, 2 * (fp.top_k or 1), experts // 8, experts // 4, experts // 2, experts}):
        if slots < (fp.top_k or 1) or slots > experts:
            continue
        budget = slots * row
        # Uniform routing (the pessimistic case): a token's expert is resident with p = slots / experts.
        miss_bytes = fp.token_expert_bytes * (1 - slots / experts)
        tok_s = (bandwidth_gbps * 1e9 / miss_bytes) if miss_bytes else None
        budgets.append({"slots_per_layer": slots, "budget_gib": round(budget / GIB, 4), "fits": budget <= room,
                        "miss_gb_per_token": round(miss_bytes / 1e9, 4),
                        "io_bound_tok_s": round(tok_s, 2) if tok_s else "no reads (all resident)"})
    return {
        "model_dir": str(model_dir), "model_type": fp.model_type,
        "total_gib": round(fp.total_bytes / GIB, 3), "trunk_gib": round(fp.trunk_bytes / GIB, 3),
        "expert_gib": round(fp.expert_bytes / GIB, 3), "moe_layers": len(fp.layer_expert_bytes),
        "experts_per_layer": experts, "top_k": fp.top_k,
        "token_expert_gib": round(fp.token_expert_bytes / GIB, 4), "min_budget_gib": round(fp.min_budget_gib, 4),
        "memory_gib": round(memory_bytes / GIB, 2), "kv_cache_gib": round(kv / GIB, 3), "context": context,
        "reserve_gib": SYSTEM_RESERVE_GIB, "largest_budget_gib": round(max(room, 0) / GIB, 3),
        "fits_stock": fp.total_bytes + kv + reserve <= memory_bytes,
        "disk_gbps": round(bandwidth_gbps, 3), "budgets": budgets,
    }


def run_plan(args) -> int:
    import psutil

    model_dir = Path(args.model_dir).expanduser()
    if not model_dir.is_dir():
        raise ExpertStreamError(f"{model_dir}: not a folder; plan needs a local MLX checkpoint")
    from expert_stream.streaming.remote_code import refuse_model_file

    refuse_model_file(model_dir, args.trust_remote_code)  # building the model would run it
    memory = int(args.memory_gib * GIB) if args.memory_gib else psutil.virtual_memory().total
    bandwidth = args.bandwidth_gbps
    if bandwidth is None:
        from expert_stream.streaming.checkpoint import CheckpointIndex
        from expert_stream.streaming.disk_bandwidth import measure_read_bandwidth

        files = CheckpointIndex(model_dir).files
        total = min(256 << 20, sum(f.stat().st_size for f in files))
        bandwidth = measure_read_bandwidth(files, total_bytes=total,
                                           block_bytes=min(4 << 20, max(total // 16, 4096)))["gbps"]
    plan = make_plan(model_dir, args.context, memory, bandwidth)
    if args.json:
        json.dump(plan, sys.stdout, indent=2)
        print()
        return 0
    print(f"model:    {plan['model_dir']} ({plan['model_type']}, {plan['moe_layers']} MoE layers x "
          f"{plan['experts_per_layer']} experts, top-{plan['top_k']})")
    print(f"size:     {plan['total_gib']} GiB = trunk {plan['trunk_gib']} GiB + experts {plan['expert_gib']} GiB")
    print(f"memory:   {plan['memory_gib']} GiB; KV cache for {plan['context']} tokens {plan['kv_cache_gib']} GiB; "
          f"reserve {plan['reserve_gib']} GiB")
    print(f"stock:    {'fits' if plan['fits_stock'] else 'does not fit'} in memory")
    print(f"budget:   smallest {plan['min_budget_gib']} GiB, largest that fits {plan['largest_budget_gib']} GiB")
    print(f"disk:     {plan['disk_gbps']} GB/s measured")
    print("budgets (uniform routing, I/O bound; real routing is skewed and does better):")
    for b in plan["budgets"]:
        print(f"  {b['budget_gib']:>10} GiB  {b['slots_per_layer']:>4} slots/layer  "
              f"{'fits' if b['fits'] else 'too big':>7}  {b['miss_gb_per_token']} GB read/token  "
              f"-> {b['io_bound_tok_s']} tok/s")
    return 0
