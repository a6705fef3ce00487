"""Is a checkpoint an MoE one? Decided from config.json and the shard headers, no data read:
the config names an expert count and some tensor is stacked over that many experts."""

import re

from expert_stream.plugin.hookspecs import hookimpl

# Config keys that hold the number of routed experts, across mlx-lm models.
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
                     "num_routed_experts", "n_experts")


def expert_count(config: dict) -> int | None:
    for source in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        for key in EXPERT_COUNT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 1:
                return value
    return None


# One tensor per expert (a Hugging Face layout, not converted): still an MoE checkpoint, which
# the loader then refuses with the way to convert it.
UNSTACKED = re.compile(r"\.experts\.\d+\.")


@hookimpl(trylast=True)
def detect_moe(index):
    count = expert_count(index.config)
    if count is None:
        return False
    return any((info.shape and info.shape[0] == count and ("expert" in name or "switch_mlp" in name))
               or UNSTACKED.search(name) for name, info in index.tensors.items())
