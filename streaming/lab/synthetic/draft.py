"""Draft models for speculative decoding with a streamed MoE (benchmark and test lab code).

A draft must share the main model's tokenizer. Two kinds, each written as what `mlx_lm.load`
reads (config.json, model.safetensors, the main model's tokenizer files copied verbatim):

- dense: a small random-weight dense qwen3 with the main model's vocabulary. Its guesses are
  noise, so almost every draft token is rejected: it exercises the verify pass and the cache
  trim, never a high acceptance.
- truncated: the main model's own first N layers with its embedding, final norm and head (an
  early-exit draft, as self-speculative decoding uses). It shares the trained trunk, so on a
  trained model its guesses agree with the main model often enough to measure acceptance. It
  keeps the main model's architecture (an MoE of N layers); it is loaded stock, every expert
  resident, which on the small trained fixture costs N/L of its experts' bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import SyntheticError
from .writer import SYNTH_FILE

# Files of a checkpoint folder that are weights or describe the model itself, never copied.
_NOT_TOKENIZER = ("config.json", "model.safetensors.index.json", SYNTH_FILE)


def _main_config(main_dir: Path) -> dict:
    path = main_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SyntheticError(f"--draft-for {main_dir}: cannot read {path.name} ({exc})") from None


def _copy_tokenizer(main_dir: Path, out: Path) -> None:
    copied = []
    for f in sorted(main_dir.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_TOKENIZER:
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    if not any(name.startswith("tokenizer") for name in copied):
        raise SyntheticError(f"--draft-for {main_dir}: no tokenizer files to copy (tokenizer.json, ...)")


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def make_dense_draft(main_dir, out, layers: int = 2, hidden: int = 128, seed: int = 0) -> Path:
    """A random-weight dense qwen3 of `layers` layers and width `hidden`, with the main model's
    vocabulary and tokenizer (float32: MLX's CPU backend runs it fastest)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    main_dir, out = Path(main_dir).expanduser(), Path(out).expanduser()
    if layers < 1 or hidden < 64 or hidden % 64:
        raise SyntheticError(f"dense draft: layers {layers} (at least 1), hidden {hidden} (a multiple of 64)")
    text = _text_config(_main_config(main_dir))
    vocab = int(text["vocab_size"])
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden,
        "num_hidden_layers": layers, "intermediate_size": 2 * hidden, "num_attention_heads": hidden // 64,
        "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "max_position_embeddings": int(text.get("max_position_embeddings", 4096)), "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in text:
            config[key] = text[key]
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(main_dir, out)
    return out


def make_truncated_draft(main_dir, out, layers: int) -> Path:
    """The main model's first `layers` layers, embedding, final norm and head (same tensors,
    same quantization): an early-exit draft of the same architecture."""
    import re

    import mlx.core as mx

    main_dir, out = Path(main_dir).expanduser(), Path(out).expanduser()
    config = _main_config(main_dir)
    text = _text_config(config)
    total = int(text["num_hidden_layers"])
    if not 1 <= layers < total:
        raise SyntheticError(f"truncated draft of {main_dir}: --draft-layers {layers}, expected 1..{total - 1}")
    layer_of = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    weights = {}
    for shard in sorted(main_dir.glob("*.safetensors")):
        for name, tensor in mx.load(str(shard)).items():
            if _layer(layer_of, name) < layers:
                weights[name] = tensor
    if not weights:
        raise SyntheticError(f"truncated draft of {main_dir}: no *.safetensors tensors found")
    text["num_hidden_layers"] = layers
    for key in ("quantization", "quantization_config"):  # drop the per-layer entries of cut layers
        q = config.get(key)
        if isinstance(q, dict):
            config[key] = {k: v for k, v in q.items() if _layer(layer_of, k) < layers}
    if isinstance(text.get("layer_types"), list):  # per-layer lists follow the cut
        text["layer_types"] = text["layer_types"][:layers]
    if isinstance(text.get("mlp_only_layers"), list):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < layers]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(main_dir, out)
    return out


def _layer(pattern, name: str) -> int:
    """The layer number in a tensor or module name; -1 for names outside the layers."""
    m = pattern.search(name + ".")
    return int(m.group(1)) if m else -1
