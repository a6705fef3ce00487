"""The soak's checkpoints (two streamed MoE models, a dense one, and a third MoE model the
faults add and remove) and the answers stock mlx-lm gives, computed once up front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from expert_stream.streaming.lab.synthetic import is_complete, make_checkpoint
from expert_stream.streaming.lab.synthetic.dense import make_dense_checkpoint

MOE = dict(arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_hidden=64, bits=4, dtype="float32")
# Served name -> (folder name, how it is made). moe-c is the model the faults add and remove.
MODELS = {"moe-a": ("moe-a", dict(MOE, seed=0)), "moe-b": ("moe-b", dict(MOE, seed=1, experts=16, top_k=4)),
          "moe-c": ("moe-c", dict(MOE, seed=2)), "dense": ("dense", None)}
STREAMED = ("moe-a", "moe-b", "moe-c")
# The long prompts run prefill in several chunks (prefill_step is 64 in the soak).
LONG = " ".join(f"def f{i}(x): return x * {i} + sum(range({i}))  # line {i}" for i in range(60))
PROMPTS = {"short": ("Tell me about solid state drives.", 16), "tiny": ("hi", 12),
           "long": (LONG, 8), "code": ("Write a function that adds two numbers.\n" * 8, 10)}


@dataclass(frozen=True)
class SoakModels:
    folders: dict  # served name -> checkpoint folder
    expected: dict  # (served name, prompt name) -> stock greedy text


def make_models(root: Path) -> dict:
    """{served name: folder}, each made once (kept when already there)."""
    folders = {}
    for served, (name, spec) in MODELS.items():
        out = Path(root) / name
        if spec is None:
            folders[served] = make_dense_checkpoint(out)
        else:
            folders[served] = out if is_complete(out) else make_checkpoint(out, progress=False, **spec)
    return folders


def stock_answers(folders: dict) -> dict:
    """Greedy chat completions of every prompt on every model by stock mlx-lm, in this process."""
    import mlx_lm

    expected = {}
    for served, folder in folders.items():
        model, tokenizer = mlx_lm.load(str(folder))
        for name, (prompt, max_tokens) in PROMPTS.items():
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            expected[(served, name)] = mlx_lm.generate(model, tokenizer, tokenizer.encode(text),
                                                       max_tokens=max_tokens)
        del model
    return expected


def prepare(root: Path) -> SoakModels:
    folders = make_models(root)
    return SoakModels(folders, stock_answers(folders))
