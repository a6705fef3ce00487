"""Synthetic MoE checkpoints: random weights for many mlx-lm architectures, laid out exactly as
a converted mlx-community model (config, sharded safetensors, index, tokenizer), written shard by
shard so a checkpoint can be larger than memory. Used by the tests, the demo and benchmarks.

    from expert_stream.streaming.lab.synthetic import make_checkpoint, estimate_size
    path = make_checkpoint(tmp / "q", "qwen3_moe", layers=4, experts=32, dtype="float32")
"""

from .registry import PRESETS, all_architectures
from .sizing import estimate_size, layers_for_target
from .spec import DEFAULT_VOCAB_SIZE
from .writer import SYNTH_FILE, is_complete, make_checkpoint, read_synth

# Architectures the installed mlx-lm can build (laguna needs mlx-lm >= 0.32).
ARCHITECTURES: tuple[str, ...] = all_architectures()

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_VOCAB_SIZE",
    "PRESETS",
    "SYNTH_FILE",
    "estimate_size",
    "is_complete",
    "layers_for_target",
    "make_checkpoint",
    "read_synth",
]
