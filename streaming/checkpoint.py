"""Checkpoint index: every tensor's file and byte range, read from safetensors headers only.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names
to dtype, shape and data_offsets (relative to the end of the header), then the raw data. Nothing
here reads tensor data, so indexing a 600 GB checkpoint costs a few header reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, ShardChangedError

# Bytes per element of the safetensors dtypes MLX checkpoints use.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


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


@dataclass(frozen=True)
class NeededTensors:
    """The tensors one process of a pipeline loads (`who` names it in errors, e.g. "rank 1")."""

    names: frozenset
    who: str

    def check_shards(self, index: Path, weight_map: dict, missing: list[str]) -> None:
        """Shards missing here are fine unless they hold a needed tensor."""
        unlisted = sorted(n for n in self.names if n not in weight_map)
        if unlisted:
            raise CheckpointError(
                f"{index}: {self.who} needs tensor {unlisted[0]}, which its weight_map does not list; "
                "pipeline loading needs an MLX-converted checkpoint"
            )
        for shard in missing:
            wanted = sorted(n for n in self.names if weight_map[n] == shard)
            if wanted:
                raise CheckpointError(
                    f"{index.parent / shard}: missing, but {self.who} needs it for {len(wanted)} tensor(s) "
                    f"of its layers ({wanted[0]}, ...); copy that shard to this machine"
                )


@dataclass(frozen=True)
class ShardIdentity:
    """What a shard was when its header was indexed. Expert bytes are read later, at their
    offsets in that header: a file changed since (rewritten in place, copied over, replaced by
    a rename) would give another file's bytes, so every read checks the shard is still this."""

    path: Path
    device: int
    inode: int
    size: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def of(cls, path: Path, st: os.stat_result, header: bytes) -> "ShardIdentity":
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, hashlib.sha256(header).hexdigest())

    def changed(self, st: os.stat_result) -> str | None:
        """How `st` (of the open file or of the path now) differs from this identity, or None."""
        if (st.st_dev, st.st_ino) != (self.device, self.inode):
            return "it was replaced by another file"
        if st.st_size != self.size:
            return f"its size changed from {self.size} to {st.st_size} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was modified"
        return None

    def check_open(self, fd: int) -> None:
        """At load: the descriptor the reader opened is the indexed file, header and all."""
        why = self.changed(os.fstat(fd))
        if why is None:
            head = os.pread(fd, 8, 0)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = os.pread(fd, length, 8) if length <= MAX_HEADER_BYTES else b""
            if hashlib.sha256(header).hexdigest() != self.header_sha256:
                why = "its header changed"
        if why is not None:
            raise self.error(why)

    def check_now(self, fd: int) -> None:
        """After a read: the open file was not modified and the path still names it."""
        why = self.changed(os.fstat(fd))
        if why is None:
            try:
                why = self.changed(os.stat(self.path))
            except OSError as exc:
                why = f"it can no longer be opened ({exc.strerror})"
        if why is not None:
            raise self.error(why)

    def error(self, why: str) -> ShardChangedError:
        return ShardChangedError(
            f"shard {self.path} changed on disk since the model was loaded ({why}); its experts can no "
            "longer be read consistently, so this model stops here: reload it"
        )


class CheckpointIndex:
    """All tensors of an MLX checkpoint folder, from shard headers, validated against file sizes."""

    def __init__(self, model_dir: str | Path, needed: "NeededTensors | None" = None):
        """`needed`: only these tensors must be present (a pipeline rank's layers); shards of
        the index that hold none of them may be missing from this machine."""
        self.model_dir = Path(model_dir).expanduser()
        self.needed = needed
        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: not found; a model folder needs config.json")
        self.config = _load_json(config_path)
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: not a JSON object")
        self.files = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        self.identities: list[ShardIdentity] = []
        for i, path in enumerate(self.files):
            infos, identity = _read_header(path, i)
            self.identities.append(identity)
            for info in infos:
                self._check_tensor(info)
                self.tensors[info.name] = info

    def _shard_files(self) -> list[Path]:
        """The shards stock mlx-lm loads (every model*.safetensors of the folder), checked
        against the index where there is one: the two must name the same files."""
        files = sorted(self.model_dir.glob("model*.safetensors"))
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: not a regular file; a shard must be a safetensors file")
        self.weight_map = self._weight_map()
        if self.weight_map is not None:
            index = self.model_dir / INDEX_NAME
            names = sorted(set(self.weight_map.values()))
            missing = [n for n in names if not (self.model_dir / n).is_file()]
            if missing and self.needed is not None:
                self.needed.check_shards(index, self.weight_map, missing)
                missing = []
            if missing:
                raise CheckpointError(
                    f"{self.model_dir}: shard(s) {', '.join(missing)} listed in "
                    f"{index.name} are missing; re-download or re-convert the checkpoint"
                )
            unlisted = [p.name for p in files if p.name not in set(names)]
            if unlisted:
                raise CheckpointError(
                    f"{index}: shard(s) {', '.join(unlisted)} of the folder are not in its weight_map, "
                    "but mlx-lm loads every model*.safetensors file: remove the stray shard(s) or "
                    "re-convert the checkpoint"
                )
        if not files:
            raise CheckpointError(f"{self.model_dir}: no model*.safetensors shards found")
        return files

    def _weight_map(self) -> dict[str, str] | None:
        index = self.model_dir / INDEX_NAME
        if not index.is_file():
            return None
        data = _load_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index}: no readable weight_map (an object of tensor name -> shard file name)")
        for name in set(weight_map.values()):
            if Path(name).name != name or not name.startswith("model") or not name.endswith(".safetensors"):
                raise CheckpointError(f"{index}: weight_map names {name!r}, not a model*.safetensors file of the folder")
        return weight_map

    def _check_tensor(self, info: "TensorInfo") -> None:
        """A tensor in two shards, or in another shard than the index says, would make stock
        and the engine read different bytes (stock keeps whichever file it loads last)."""
        here = self.files[info.file]
        if info.name in self.tensors:
            other = self.files[self.tensors[info.name].file]
            raise CheckpointError(
                f"{here}: tensor {info.name} is also in {other.name}; a tensor must be in one shard only"
            )
        listed = self.weight_map.get(info.name) if self.weight_map is not None else None
        if listed is not None and listed != here.name:
            raise CheckpointError(
                f"{here}: tensor {info.name} is here, but {INDEX_NAME} puts it in {listed}; re-convert the checkpoint"
            )

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


def _read_header(path: Path, file_index: int) -> tuple[list[TensorInfo], ShardIdentity]:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # opening a FIFO would block until a writer comes
            raise CheckpointError(f"{path}: not a regular file; a shard must be a safetensors file")
        size = st.st_size
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
    header = _parse_json(raw, path, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header does not parse (not a JSON object)")
    data_start = 8 + header_len
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry_fields(entry)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {_short(entry)}")
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
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
    return infos, ShardIdentity.of(path, st, raw)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _entry_fields(entry):
    """(dtype, shape, begin, end) of a header entry, or Nones when it is malformed."""
    if not isinstance(entry, dict):
        return None, None, None, None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        not isinstance(dtype, str)
        or not isinstance(shape, list) or not all(_is_count(d) for d in shape)
        or not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return None, None, None, None
    return dtype, tuple(shape), offsets[0], offsets[1]


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_json(raw: str | bytes, path: Path, what: str):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: {what} does not parse ({exc})") from None


def _load_json(path: Path):
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    return _parse_json(text, path, "JSON")
