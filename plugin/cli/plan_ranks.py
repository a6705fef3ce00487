"""`expert-stream plan MODEL --ranks N`: what each machine of mlx_lm.server's pipeline mode holds
(mlx-lm's own layer split), and the budgets that fit it beside its trunk and its share of the KV
cache. Every machine is taken to have the memory `--memory-gib` says (default: this one's)."""

from __future__ import annotations

from pathlib import Path

GIB = 1 << 30


def rank_plan(model_dir: Path, ranks: int, context: int, memory_bytes: int, reserve_bytes: int,
              trust_remote_code: bool = False) -> dict:
    """`reserve_bytes`: MLX's cache and the headroom, on every machine."""
    from expert_stream.plugin import plugins
    from expert_stream.plugin.config import footprint
    from expert_stream.streaming.pipeline_split import rank_shares

    shares = rank_shares(model_dir, ranks, plugins.architectures(), trust_remote_code)
    layers = shares[0].model_layers
    kv_all = footprint(model_dir, plugins.architectures(), trust_remote_code).kv.bytes_for(context)
    covered = sorted(i for s in shares for i in range(s.first_layer, min(s.end_layer, layers)))
    out = []
    for s in shares:
        held = max(min(s.end_layer, layers) - s.first_layer, 0)
        kv = kv_all * held // max(layers, 1)  # its share of the whole model's KV cache, by layers
        room = memory_bytes - s.trunk_bytes - kv - reserve_bytes
        out.append({
            "rank": s.rank, "layers": [s.first_layer, s.first_layer + held], "moe_layers": s.moe_layers,
            "trunk_gib": round(s.trunk_bytes / GIB, 4), "expert_gib": round(s.expert_bytes / GIB, 4),
            "kv_cache_gib": round(kv / GIB, 4), "min_budget_gib": round(s.min_budget_bytes / GIB, 4),
            "largest_budget_gib": round(max(room, 0) / GIB, 4),
            "fits": room >= s.min_budget_bytes,
            "all_experts_fit": room >= s.expert_bytes,
        })
    gaps = sorted(set(range(layers)) - set(covered))
    twice = sorted({i for i in covered if covered.count(i) > 1})
    return {"ranks": ranks, "per_rank": out, "layers_without_rank": gaps, "layers_on_two_ranks": twice}


def print_rank_plan(plan: dict) -> None:
    print(f"pipeline: {plan['ranks']} ranks (mlx-lm's split: rank 0 runs the last layers); "
          "budget_gib is per rank, budget_gib_by_rank sets each")
    for r in plan["per_rank"]:
        first, end = r["layers"]
        held = f"layers {first}-{end - 1}" if end > first else "no layers"
        print(f"  rank {r['rank']}: {held} ({r['moe_layers']} MoE), trunk {r['trunk_gib']} GiB, "
              f"experts {r['expert_gib']} GiB, KV {r['kv_cache_gib']} GiB; budget {r['min_budget_gib']} GiB "
              f"smallest, {r['largest_budget_gib']} GiB largest that fits"
              + ("" if r["fits"] else " (does not fit)") + (", every expert fits" if r["all_experts_fit"] else ""))
    if plan["layers_without_rank"] or plan["layers_on_two_ranks"]:
        print(f"  warning: this mlx-lm's pipeline() leaves layers {plan['layers_without_rank']} to no rank and "
              f"gives {plan['layers_on_two_ranks']} to two with {plan['ranks']} ranks; pick a rank count that "
              "divides the layers")
