"""Damaged safetensors headers and indexes: a clear CheckpointError naming the file, or, where the
damage leaves a checkpoint stock mlx-lm loads, output exactly stock's; never anything else.

Mutants come from a fixed seed: a header entry's field replaced by a value of another type or
range (Infinity, 1e400, negative, huge, lists, objects, deep nesting), keys removed, tensors
duplicated across shards, index weight maps of the wrong shape, shards left out of the index."""

from __future__ import annotations

import json
import random
import shutil
import struct

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

import expert_stream
from exactness import prompt_ids
from expert_stream.streaming.checkpoint import CheckpointIndex
from expert_stream.streaming.errors import CheckpointError, ExpertStreamError
from expert_stream.streaming.footprint import checkpoint_footprint

ODD_VALUES = [
    "Infinity", "-Infinity", "NaN", "1e400", "-1", str(2**70), "1.5", '"abc"', "[]", "[1, 2, 3]",
    "{}", "null", "true", '["F32"]', "[" * 3000 + "]" * 3000, '{"a": ' * 3000 + "1" + "}" * 3000,
]


def _read(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header_text: str, data: bytes):
    encoded = header_text.encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _header_mutant(rng, shards):
    """Rewrite one shard's header with one field made odd; returns the shard."""
    shard = rng.choice(shards)
    header, data = _read(shard)
    name = rng.choice([k for k in header if k != "__metadata__"])
    kind = rng.randrange(6)
    if kind == 0:  # a field replaced by an odd JSON value (spliced in as text)
        field = rng.choice(["dtype", "shape", "data_offsets"])
        marker = "\u0000MUTANT\u0000"
        header[name][field] = marker
        text = json.dumps(header).replace(json.dumps(marker), rng.choice(ODD_VALUES))
    elif kind == 1:  # one element of shape / offsets made odd
        field = rng.choice(["shape", "data_offsets"])
        marker = "\u0000MUTANT\u0000"
        values = header[name][field] or [0]
        values[rng.randrange(len(values))] = marker
        header[name][field] = values
        text = json.dumps(header).replace(json.dumps(marker), rng.choice(ODD_VALUES))
    elif kind == 2:  # a key removed
        del header[name][rng.choice(["dtype", "shape", "data_offsets"])]
        text = json.dumps(header)
    elif kind == 3:  # another dtype, same or other width
        header[name]["dtype"] = rng.choice(["F8_E4M3", "I32", "U32", "F16", "BF16", "F64", "U8", "Q4", "bf16"])
        text = json.dumps(header)
    elif kind == 4:  # offsets moved
        begin, end = header[name]["data_offsets"]
        shift = rng.choice([1, -1, 8, 4096, -(begin + 1)])
        header[name]["data_offsets"] = [begin + shift, end + shift]
        text = json.dumps(header)
    else:  # the whole entry replaced
        header[name] = json.loads(rng.choice(['[]', '"x"', '{}', '{"dtype": "F32"}', "7"]))
        text = json.dumps(header)
    _write(shard, text, data)
    return shard


def _index_mutant(rng, model, shards):
    """Damage the index, or the folder's shards against it; returns the file the error must name."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    kind = rng.randrange(6)
    if kind == 0:
        index["weight_map"] = json.loads(rng.choice(['[]', '"x"', "7", "null", '[["a", "b"]]']))
    elif kind == 1:
        key = rng.choice(list(index["weight_map"]))
        index["weight_map"][key] = json.loads(rng.choice(["7", "[]", '"../model.safetensors"', '"other.bin"']))
    elif kind == 2:  # a shard left out of the index
        gone = rng.choice(shards).name
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != gone}
    elif kind == 3:  # a tensor listed in the wrong shard
        key = rng.choice(list(index["weight_map"]))
        others = [s.name for s in shards if s.name != index["weight_map"][key]]
        index["weight_map"][key] = rng.choice(others)
    elif kind == 4:  # a tensor present in two shards
        a, b = rng.sample(shards, 2)
        ha, data_a = _read(a)
        hb, data_b = _read(b)
        name = rng.choice([k for k in hb if k != "__metadata__"])
        entry = dict(hb[name])
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        entry["data_offsets"] = [len(data_a), len(data_a) + size]
        ha[name] = entry
        _write(a, json.dumps(ha), data_a + bytes(size))
        return a
    else:
        index_path.write_text(rng.choice(["[" * 5000 + "]" * 5000, "not json", '{"weight_map": ' * 3000]))
        return index_path
    index_path.write_text(json.dumps(index))
    return index_path


def _outcome(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the test sorts every outcome
        return None, exc


def _logits(model):
    out = model(prompt_ids(6))
    mx.eval(out)
    return out


@pytest.mark.slow
def test_damaged_headers_and_indexes(checkpoints, tmp_path):
    src = checkpoints("qwen3_moe", layers=2, shard_size_mb=1, bits=0)
    budget = checkpoint_footprint(src).min_budget_gib
    rng = random.Random(1234)
    counts = {"clear error": 0, "exact": 0, "stock fails too": 0}
    wrong = []  # every outcome that is neither
    for case in range(300):
        model = tmp_path / f"m{case}"
        shutil.copytree(src, model)
        shards = sorted(model.glob("model*.safetensors"))
        damaged = _header_mutant(rng, shards) if case % 3 else _index_mutant(rng, model, shards)
        _, err = _outcome(lambda: CheckpointIndex(model))
        if err is None:
            loaded, err = _outcome(lambda: expert_stream.load(model, budget_gib=budget))
        if isinstance(err, ExpertStreamError):
            if damaged.name in str(err) or str(model) in str(err):
                counts["clear error"] += 1
            else:
                wrong.append(f"case {case}: the error does not name {damaged.name}: {err}")
        elif err is not None:
            stock, stock_err = _outcome(lambda: load_model(model))
            if stock_err is not None and type(stock_err) is type(err):
                counts["stock fails too"] += 1
            else:
                wrong.append(f"case {case}: {type(err).__name__}: {str(err)[:200]} (stock: {stock_err!r:.200})")
        else:
            streamed, _, handle = loaded
            stock, _ = load_model(model)
            a, b = _outcome(lambda: _logits(stock)), _outcome(lambda: _logits(streamed))
            if a[1] is None and not (b[1] is None and mx.array_equal(a[0], b[0], equal_nan=True).item()):
                wrong.append(f"case {case}: output differs from stock's")
            elif a[1] is not None and not isinstance(b[1], (type(a[1]), ExpertStreamError)):
                wrong.append(f"case {case}: {b[1]!r} where stock raised {a[1]!r}")
            else:
                counts["exact"] += 1
            handle.close()
        shutil.rmtree(model)
    print(counts)
    assert not wrong, "\n".join(wrong)
    assert counts["clear error"] > 200, counts


def test_f8_scales_stream_exactly(checkpoints, tmp_path):
    """Expert scales stored as F8_E4M3 (mx.load gives them as uint8, as MLX's own U8 scales):
    streamed output equals stock's."""
    from exactness import assert_same_logits, load_pair

    src = checkpoints("qwen3_moe", layers=2, bits="mxfp4", shard_size_mb=1)
    model = tmp_path / "m"
    shutil.copytree(src, model)
    relabelled = 0
    for shard in sorted(model.glob("model*.safetensors")):
        header, data = _read(shard)
        for name, entry in header.items():
            if name.endswith("switch_mlp.down_proj.scales") and entry["dtype"] == "U8":
                entry["dtype"] = "F8_E4M3"
                relabelled += 1
        _write(shard, json.dumps(header), data)
    assert relabelled == 2
    stock, streamed, handle = load_pair(model, prefetch=False)
    assert_same_logits(stock, streamed, prompt_ids(12), decode_steps=3)
    handle.close()


def test_tensor_in_two_shards_is_refused(checkpoints, tmp_path):
    src = checkpoints("qwen3_moe", layers=2, shard_size_mb=1, bits=0)
    model = tmp_path / "m"
    shutil.copytree(src, model)
    a, b = sorted(model.glob("model*.safetensors"))[:2]
    ha, data_a = _read(a)
    hb, _ = _read(b)
    name = next(k for k in hb if k != "__metadata__")
    entry = dict(hb[name])
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    entry["data_offsets"] = [len(data_a), len(data_a) + size]
    ha[name] = entry
    _write(a, json.dumps(ha), data_a + bytes(size))
    with pytest.raises(CheckpointError, match=rf"tensor {name} is (also in|here, but)"):
        CheckpointIndex(model)


def test_shard_left_out_of_the_index_is_refused(checkpoints, tmp_path):
    src = checkpoints("qwen3_moe", layers=2, shard_size_mb=1, bits=0)
    model = tmp_path / "m"
    shutil.copytree(src, model)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != gone}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{gone} of the folder are not in its weight_map"):
        CheckpointIndex(model)
