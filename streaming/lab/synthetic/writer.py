"""Write a synthetic checkpoint laid out as `mlx_lm.convert` lays one out (config.json with its
quantization block, model*.safetensors shards with {"format": "mlx"} metadata, the index, the
tokenizer files), a tensor chunk at a time so the checkpoint can be larger than memory (36 GB
in 18 shards: 89 s, 271 MB peak RSS here).

The checkpoint is built in a hidden sibling folder and renamed into place when complete: a
killed run never leaves a folder that looks like a checkpoint. `synth.json`, written last, holds
the arguments; a folder whose synth.json matches is returned as it is (a cache)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Optional

from .errors import SyntheticError
from .mtp import nbytes
from .shards import write_shards
from .sizing import summarize
from .spec import SynthSpec, materialize, resolve_spec
from .tokenizer import ENDOFTEXT, IM_END, write_tokenizer

SYNTH_FILE = "synth.json"


def make_checkpoint(
    out_dir,
    arch: str = "qwen3_moe",
    *,
    layers: Optional[int] = None,
    experts: Optional[int] = None,
    top_k: Optional[int] = None,
    hidden: Optional[int] = None,
    moe_hidden: Optional[int] = None,
    bits=None,
    group_size: Optional[int] = None,
    mixed_bits=None,
    dtype: str = "bfloat16",
    seed: int = 0,
    vocab_size: Optional[int] = None,
    shard_size_mb: int = 2048,
    vlm_layout: bool = False,
    overrides: Optional[dict] = None,
    progress: bool = True,
) -> Path:
    """Write a random-weight checkpoint of `arch` into `out_dir` and return `out_dir`.

    bits: None = the family's usual export (4-bit affine; mxfp4 for gpt_oss; 2-bit group 128 for
    prism_hadamard_qwen35, its only recipe), an int = affine bits (0 = unquantized), "mxfp4".
    group_size: None = the family's (64 affine, 32 mxfp4).
    mixed_bits: expert blocks of some layers at other bits: {layer: bits}, "0:8,2:8", or one
    bit width for every odd layer. overrides: merged into the (text) config."""
    spec = resolve_spec(
        arch,
        layers=layers,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        moe_hidden=moe_hidden,
        bits=bits,
        group_size=group_size,
        mixed_bits=mixed_bits,
        dtype=dtype,
        seed=seed,
        vocab_size=vocab_size,
        shard_size_mb=shard_size_mb,
        vlm_layout=vlm_layout,
        overrides=overrides,
    )
    out = Path(out_dir).expanduser().absolute()
    identity = spec.identity()
    if is_complete(out, identity):
        return out
    if out.exists() and any(out.iterdir()) and not (out / SYNTH_FILE).exists():
        raise SyntheticError(
            f"{out} exists and is not a synthetic checkpoint (no {SYNTH_FILE}); refusing to "
            f"overwrite it. Pick an empty or new folder."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write(tmp, spec, identity, progress)
        _install(tmp, out, identity)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_synth(path) -> Optional[dict]:
    """The synth.json of a checkpoint folder (arguments, files, sizes), or None."""
    try:
        return json.loads((Path(path) / SYNTH_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path, identity: Optional[dict] = None) -> bool:
    """True when `path` holds a finished synthetic checkpoint (of `identity`, if given)."""
    info = read_synth(path)
    if info is None or (identity is not None and info.get("identity") != identity):
        return False
    try:
        return all((path / f).stat().st_size == n for f, n in info["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def _write(tmp: Path, spec: SynthSpec, identity: dict, progress: bool) -> None:
    from tqdm import tqdm

    tmp.mkdir(parents=True)
    m = materialize(spec)
    groups, config = m.groups, m.config
    summary = summarize(spec, m.weights, m.expert_names, m.total_parameters, m.mtp)
    specs = {k: (v.shape, v.dtype, v.nbytes) for k, v in m.weights.items()}
    specs.update({k: (shape, dtype, nbytes(shape, dtype)) for k, (shape, dtype) in m.mtp.items()})
    del m  # the groups must hold the only references: each tensor is freed once written
    gc.collect()

    ids = write_tokenizer(tmp, spec.vocab_size)
    config["bos_token_id"] = ids[ENDOFTEXT]
    config["eos_token_id"] = ids[IM_END]
    config["pad_token_id"] = ids[ENDOFTEXT]
    _save_config(config, tmp / "config.json", keep_vision=spec.vlm_layout)
    _write_json(
        tmp / "generation_config.json",
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
        },
    )

    total = sum(v[2] for v in specs.values())
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"synth {spec.arch}",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        weight_map = write_shards(tmp, specs, groups, spec.shard_size_mb << 20, bar.update)
    del groups

    index = {
        "metadata": {
            "total_size": total,
            "total_parameters": summary["total_parameters"],
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(tmp / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)

    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    _write_json(
        tmp / SYNTH_FILE,
        {"identity": identity, "files": files, "sizes": summary,
         "shards": sorted(set(weight_map.values()))},
    )


def _install(tmp: Path, out: Path, identity: dict) -> None:
    """Move the finished folder into place; a concurrent writer of the same checkpoint may
    have won the race, which is fine."""
    trash = None
    if out.exists():
        if is_complete(out, identity):
            return
        trash = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, trash)
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_complete(out, identity):
            raise
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _save_config(config: dict, path: Path, keep_vision: bool) -> None:
    """As mlx-lm's `save_config`: drop `_name_or_path` (and `vision_config` unless this is a
    VLM export), mirror `quantization` into `quantization_config`, sort the keys."""
    config = dict(config)
    config.pop("_name_or_path", None)
    if not keep_vision:
        config.pop("vision_config", None)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    with open(path, "w") as f:
        json.dump(dict(sorted(config.items())), f, indent=4)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
