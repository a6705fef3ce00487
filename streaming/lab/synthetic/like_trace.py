"""The shape of a synthetic checkpoint that replays a routing trace: as many MoE layers as the
trace has columns, its expert count and top-k, and the expert sizes of the real model family
those two numbers identify (so bytes per expert, and so bytes per token, are the real model's).
Any of them can be given instead (a large family scaled down to fit a disk)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SyntheticError


@dataclass(frozen=True)
class Family:
    """A real MoE model's routed-expert shape (from its Hugging Face config)."""

    name: str
    experts: int
    top_k: int
    hidden: int
    expert_intermediate: int


# One entry per (experts, top-k): the model a trace of that routing most likely comes from.
FAMILIES = (
    Family("Llama-4-Maverick-17B-128E", 128, 1, 5120, 8192),
    Family("Qwen1.5-MoE-A2.7B", 60, 4, 2048, 1408),
    Family("OLMoE-1B-7B", 64, 8, 2048, 1024),
    Family("DeepSeek-V2-Lite", 64, 6, 2048, 1408),
    Family("Qwen3-30B-A3B", 128, 8, 2048, 768),
    Family("Qwen3-Next-80B-A3B", 512, 10, 2048, 512),
    Family("DeepSeek-V3", 256, 8, 7168, 2048),
    Family("Mixtral-8x7B", 8, 2, 4096, 14336),
    Family("gpt-oss-20b", 32, 4, 2880, 2880),
)


def family_of(experts: int, top_k: int) -> Family | None:
    for f in FAMILIES:
        if (f.experts, f.top_k) == (experts, top_k):
            return f
    return None


def like_trace_shape(trace, *, moe_layers=None, experts=None, top_k=None, hidden=None,
                     expert_intermediate=None) -> dict:
    """{moe_layers, experts, top_k, hidden, moe_hidden, family} for a checkpoint shaped like
    `trace` (a RoutingTrace); given values win over the trace's and the family's."""
    experts = int(experts or trace.num_experts)
    top_k = int(top_k or trace.top_k)
    family = family_of(int(trace.num_experts), trace.top_k)
    if (hidden is None or expert_intermediate is None) and family is None:
        known = "; ".join(f"{f.experts} experts top-{f.top_k}: {f.name}" for f in FAMILIES)
        raise SyntheticError(
            f"trace {trace.name}: no known model routes {trace.num_experts} experts top-{trace.top_k} "
            f"(known: {known}); give --hidden and --expert-intermediate"
        )
    return {
        "moe_layers": int(moe_layers or trace.num_layers),
        "experts": experts,
        "top_k": top_k,
        "hidden": int(hidden or family.hidden),
        "moe_hidden": int(expert_intermediate or family.expert_intermediate),
        "family": family.name if family else None,
        "sizes_from": "flags" if hidden is not None or expert_intermediate is not None else "family",
    }


def layers_for_moe_layers(arch: str, moe_layers: int, **kwargs) -> int:
    """The layer count of `arch` that gives `moe_layers` MoE layers (families with dense first
    layers or MoE every other layer need more), other sizes as in kwargs."""
    from .registry import get_preset
    from .sizing import estimate_size

    kwargs.pop("layers", None)
    low = get_preset(arch).min_layers

    def moe(n: int) -> int:
        return estimate_size(arch, layers=n, **kwargs)["moe_layers"]

    n = max(moe_layers, low)
    for _ in range(64):
        got = moe(n)
        if got == moe_layers:
            while n > low and moe(n - 1) == moe_layers:  # the smallest such count
                n -= 1
            return n
        if got > moe_layers and n == low:
            raise SyntheticError(f"{arch}: its smallest model ({low} layers) has {got} MoE layers, more than {moe_layers}")
        n = n + max(1, (moe_layers - got) * n // max(got, 1)) if got < moe_layers else n - 1
    raise SyntheticError(f"{arch}: no layer count gives exactly {moe_layers} MoE layers")
