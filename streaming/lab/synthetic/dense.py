"""A tiny dense (not MoE) checkpoint: mlx-lm's own qwen3 model class with random weights and the
synthetic tokenizer. What a config's `small-dense` entry is in tests and the soak: a model the
plugin must leave exactly as the host serves it."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
          "vocab_size": VOCAB, "max_position_embeddings": 2048, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "architectures": ["Qwen3ForCausalLM"]}


def make_dense_checkpoint(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `out` (kept when it already has a config.json); return `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from .tokenizer import write_tokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True)
    config = dict(CONFIG)
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    ids = write_tokenizer(out, VOCAB)
    config["eos_token_id"] = ids.get("<|im_end|>", ids.get("<|endoftext|>"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
