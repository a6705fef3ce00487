"""Checkpoint index: every tensor's file and byte range, read from safetensors headers only.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names
to dtype, shape and data_offsets (relative to the end of the header), then the raw data. Nothing
here reads tensor data, so indexing a 600 GB checkpoint costs a few header reads.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

# Bytes per element of the safetensors dtypes MLX checkpoints use.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: int  # index into CheckpointIndex.files
    dtype: str  # safetensors dtype string, e.g. "BF16", "U32"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class CheckpointIndex:
    """All tensors of an MLX checkpoint folder, from shard headers, validated against file sizes."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir).expanduser()
        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: not found; a model folder needs config.json")
        try:
            self.config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
        self.files = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        for i, path in enumerate(self.files):
            for info in _read_header(path, i):
                self.tensors[info.name] = info

    def _shard_files(self) -> list[Path]:
        index_path = self.model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: no readable weight_map ({exc})") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.model_dir / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.model_dir}: shard(s) {', '.join(missing)} listed in "
                    f"{index_path.name} are missing; re-download or re-convert the checkpoint"
                )
            return [self.model_dir / n for n in names]
        # Same rule as mlx_lm.utils.load_model when there is no index.
        files = sorted(self.model_dir.glob("model*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no model*.safetensors shards found")
        return files

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "?"))

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def find(self, name: str, candidates: list[str] | None = None) -> TensorInfo | None:
        """The tensor stored under `name` or under the first of `candidates` that exists."""
        for key in [name, *(candidates or [])]:
            if key in self.tensors:
                return self.tensors[key]
        return None

    def unstacked_experts_near(self, expert_block_path: str) -> list[str]:
        """Per-expert tensors (`<moe block>.experts.0.gate_proj.weight`) beside an expert block:
        the layout of an unconverted Hugging Face checkpoint, which stock mlx-lm stacks in
        memory at load."""
        parent = expert_block_path.rsplit(".", 1)[0]
        pattern = re.compile(re.escape(parent) + r"\.(?:[\w]+\.)?\d+\.")
        return [k for k in self.tensors if pattern.match(k) or pattern.match(k.split("language_model.", 1)[-1])]


def _read_header(path: Path, file_index: int) -> list[TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes): no safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{path}: header length {header_len} does not fit a {size}-byte file: "
                    "not a safetensors file, or truncated"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header does not parse ({exc})") from None
    data_start = 8 + header_len
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {entry!r}") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name}: data_offsets {begin}..{end} do not match "
                f"shape {list(shape)} of {dtype}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + end} "
                f"but the file has {size} bytes; re-download this shard"
            )
        infos.append(TensorInfo(name, file_index, dtype, shape, data_start + begin, data_start + end))
    return infos
