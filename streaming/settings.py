"""Streaming settings: one dataclass, validated on construction, with errors naming the key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import SettingsError

GIB = 1 << 30
AUTO = "auto"
# Tokens of KV cache an auto budget leaves room for, where the host has no context length of its
# own: a long conversation of a coding agent; longer sequences use more than was set aside.
DEFAULT_CONTEXT_LENGTH = 32768


@dataclass(frozen=True)
class StreamSettings:
    """How one model's routed experts are streamed."""

    # GiB of expert slots for all MoE layers together (the cache), or "auto": what the process
    # may use minus everything else it holds (streaming/auto_budget.py).
    budget_gib: Any = AUTO
    # Pipeline mode (several machines): this rank's budget_gib instead, one entry per rank.
    budget_gib_by_rank: Optional[tuple] = None
    # Eviction policy name (see streaming/policy.py); "default" is the best measured one.
    policy: str = "default"
    # Routing lookahead during decode: predict the next MoE layer's experts and read them early.
    # None: on, except on CUDA where it measured harmful (streaming/lab/MEASUREMENTS.md).
    prefetch: Optional[bool] = None
    # At most this many reads of guessed experts per layer per token (per guessing layer).
    prefetch_per_layer: int = 4
    # Where guessed experts are read: "buffer" (a side buffer outside the cache; a layer that
    # needs one copies it into its slot, so a wrong guess evicts nothing) or "slots".
    prefetch_into: str = "buffer"
    # How many streamed layers ahead each layer guesses (1: the next one).
    prefetch_depth: int = 1
    # How many of the probe's most likely experts make a guess (None: the model's top-k);
    # fewer reads fewer wrong guesses and covers fewer misses.
    prefetch_guesses: Optional[int] = None
    # Leave MoE layers whose experts all fit in their share of the budget as stock layers (their
    # experts load with the trunk and run at stock's speed); false streams them through slots.
    resident: bool = True
    # Routing trace (expert-stream trace) whose most used experts are loaded into the slots at load.
    warm_start: Optional[str] = None
    # Tokens per prefill chunk handed to the model (the host's prefill_step_size when it has one).
    prefill_step: int = 2048
    # Tokens a layer-major prefill holds at once (prompt_pass.py): each streamed layer reads each
    # expert once per this many prompt tokens; 0 prefills chunk by chunk (a sweep per chunk).
    prefill_window: int = 32768
    # GiB of host rows a prompt pass reads a layer's experts into as each chunk's routing
    # arrives, while the later chunks' attention still computes (fewer where memory is short);
    # 0 reads them in the layer's sweep instead.
    prefill_readahead_gib: float = 0.5
    # Split the budget over layers by measured miss curves (warm-start trace) instead of evenly.
    budget_by_trace: bool = True
    # Move slots between layers while serving, by the hit curves they measure
    # (streaming/online_budget.py).
    online_budget: bool = True
    # Reader: threads, backend ("auto" | "native" | "python") and page-cache bypass mode.
    reader_threads: int = 4
    reader: str = "auto"
    cache_bypass: str = "auto"
    # How misses reach the slots: "auto" (direct on CPU and Metal, cuda on CUDA), "direct"
    # (reader threads write slot memory), "staged" (host buffers, then one memcpy on the compute
    # thread), "cuda" (page-locked host buffers, then a CUDA driver copy) or "copy" (host
    # buffers, then an MLX scatter). See streaming/slots.py.
    slot_write: str = "auto"
    # Compute the resident experts of a decode step while its misses are read.
    overlap: bool = True
    # How a decode token's routing reaches the slots: "python" (the routing comes to the host
    # once a layer) or "native" (resolved inside the graph by native/resolve.cpp, no host wait;
    # MLX's CPU backend, and CUDA once it proves itself at load; policy lru or default, no
    # lookahead: streaming/README.md).
    decode_path: str = "python"
    # Cap on MLX's buffer cache, GiB (None leaves MLX's default, which can hoard freed memory).
    mlx_cache_limit_gib: Optional[float] = 1.0
    # Tokens of KV cache an auto budget leaves room for (a host's own context length wins).
    context_length: int = DEFAULT_CONTEXT_LENGTH
    # Lossy knobs, off by default: fewer experts per token, and skipping low-weight misses.
    top_k_override: Optional[int] = None
    skip_miss_below: Optional[float] = None

    def __post_init__(self):
        _check_types(self)
        if isinstance(self.budget_gib, str):
            if self.budget_gib != AUTO:
                raise SettingsError(f"budget_gib must be float (GiB) or {AUTO!r}, got str {self.budget_gib!r}")
            if self.mlx_cache_limit_gib is None:
                raise SettingsError("budget_gib 'auto' needs mlx_cache_limit_gib (a cap on MLX's buffer cache, "
                                    "which otherwise may grow to the whole memory): set a number of GiB")
        elif isinstance(self.budget_gib, bool) or not isinstance(self.budget_gib, (int, float)):
            raise SettingsError(f"budget_gib must be float or {AUTO!r}, got {type(self.budget_gib).__name__} "
                                f"{self.budget_gib!r}")
        elif not self.budget_gib > 0:
            raise SettingsError(f"budget_gib must be > 0 GiB, got {self.budget_gib!r}")
        if self.budget_gib_by_rank is not None:
            by_rank = self.budget_gib_by_rank
            if not isinstance(by_rank, (list, tuple)) or not by_rank or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in by_rank
            ):
                raise SettingsError(f"budget_gib_by_rank must be a list of budgets > 0 GiB, one per rank; got {by_rank!r}")
            object.__setattr__(self, "budget_gib_by_rank", tuple(float(b) for b in by_rank))
        if self.prefetch_per_layer < 0:
            raise SettingsError("prefetch_per_layer must be >= 0")
        if self.prefill_step < 1:
            raise SettingsError("prefill_step must be >= 1")
        if self.reader_threads < 1:
            raise SettingsError("reader_threads must be >= 1")
        _check_choice("reader", self.reader, ("auto", "native", "python"))
        _check_choice("cache_bypass", self.cache_bypass, ("auto", "direct", "fadvise", "nocache", "none"))
        _check_choice("slot_write", self.slot_write, ("auto", "direct", "staged", "cuda", "copy"))
        _check_choice("prefetch_into", self.prefetch_into, ("buffer", "slots"))
        _check_choice("decode_path", self.decode_path, ("python", "native"))
        if self.prefetch_depth < 1:
            raise SettingsError("prefetch_depth must be >= 1")
        if self.top_k_override is not None and self.top_k_override < 1:
            raise SettingsError("top_k_override must be >= 1")
        if self.skip_miss_below is not None and not 0 <= self.skip_miss_below < 1:
            raise SettingsError("skip_miss_below must be in [0, 1)")
        _check_ranges(self)  # after the checks above, whose messages say more
        from .policy import POLICIES  # names registered there, plugins' included

        _check_choice("policy", self.policy, tuple(POLICIES))
        if self.decode_path == "native":
            _check_native(self)
        if self.warm_start is not None and not Path(self.warm_start).expanduser().is_file():
            raise SettingsError(f"warm_start: trace file {self.warm_start} does not exist")

    @property
    def auto(self) -> bool:
        """The budget fits itself to memory (budget_gib: auto)."""
        return self.budget_gib == AUTO

    @property
    def budget_bytes(self) -> int:
        """The number set; an auto budget is resolved by streaming/auto_budget.py instead."""
        if self.auto:
            raise ValueError("budget_gib is 'auto': resolve it (streaming/auto_budget.py) before asking for bytes")
        return int(self.budget_gib * GIB)

    @property
    def exact(self) -> bool:
        """False when a lossy knob is on (output may differ from stock)."""
        return self.top_k_override is None and self.skip_miss_below is None

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str = "settings") -> "StreamSettings":
        refuse_removed(values, where)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(values) - known))
        if unknown:
            raise SettingsError(
                f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**values)
        except SettingsError as exc:
            raise SettingsError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Settings that existed and were taken out, with why: a config that still sets one is refused
# with the reason rather than run without it.
REMOVED = {
    "speculate": "speculative decode was removed: on replayed real routing it was slower than "
                 "layer-by-layer decode at every budget measured",
    "speculate_check_every": "it tuned speculative decode, which was removed (see speculate)",
}


def budget_from_text(text: str):
    """budget_gib as a command line gives it: `auto` or a number of GiB."""
    return text if text == AUTO else float(text)


def refuse_removed(keys, where: str = "settings") -> None:
    """Raise SettingsError naming the first removed setting among `keys`, and why it went."""
    for key in sorted(set(map(str, keys)) & set(REMOVED)):
        raise SettingsError(f"{where}: setting {key!r} no longer exists: {REMOVED[key]}; delete it from the config")


MAX_GIB = 1 << 20  # 1 PiB: beyond any machine, below where a byte count stops being exact
# Finite bounds of the numeric settings (NaN and .inf fall outside); None: that side unbounded.
_RANGES = {"budget_gib": (0, MAX_GIB), "mlx_cache_limit_gib": (0, MAX_GIB), "reader_threads": (1, 256),
           "context_length": (1, 1 << 24),
           "prefetch_per_layer": (0, 4096), "prefetch_depth": (1, 64), "prefetch_guesses": (1, 4096), "prefill_step": (1, 1 << 20),
           "prefill_window": (0, 1 << 24), "prefill_readahead_gib": (0, MAX_GIB),
           "top_k_override": (1, 4096), "skip_miss_below": (0, 1)}


def _check_ranges(settings) -> None:
    for name, (low, high) in _RANGES.items():
        value = getattr(settings, name)
        if value is not None and value != AUTO and not low <= value <= high:
            raise SettingsError(f"{name} must be between {low} and {high}, got {value!r}")


def _check_native(settings) -> None:
    """decode_path native resolves misses inside the graph, where no routing reaches the host:
    what needs it there is refused by name, not left silently off."""
    from .policy import NATIVE_POLICIES, POLICIES

    names = ", ".join(n for n, cls in POLICIES.items() if cls in NATIVE_POLICIES)
    needs = {
        "policy": (POLICIES.get(settings.policy) in NATIVE_POLICIES, f"it runs these policies: {names}"),
        "prefetch": (settings.prefetch is not True, "the lookahead guesses from routing on the host: leave prefetch unset"),
        "skip_miss_below": (settings.skip_miss_below is None, "skipping a miss needs its routing weight on the host"),
    }
    for name, (ok, why) in needs.items():
        if not ok:
            raise SettingsError(f"decode_path native: {name} {getattr(settings, name)!r} does not go with it; {why}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


_TYPES = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}


def _check_types(settings: StreamSettings) -> None:
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        kind = str(f.type).replace("Optional[", "").rstrip("]")
        if value is None and "Optional" in str(f.type):
            continue
        allowed = _TYPES.get(kind)
        if allowed is None:
            continue
        # bool is an int in Python; a budget of True is a mistake, not 1 GiB.
        if isinstance(value, bool) and kind != "bool" or not isinstance(value, allowed):
            raise SettingsError(f"{f.name} must be {kind}, got {type(value).__name__} {value!r}")
