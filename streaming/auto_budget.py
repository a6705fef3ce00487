"""`budget_gib: auto`: the slot budget is what the process may use minus what it needs besides
slots: the trunk, the KV cache for the context length, MLX's buffer cache, the other models
held, and a headroom. Never below the smallest budget (one token's experts in every MoE layer),
never beyond the model's own experts.

Several models share one limit: `share` splits what is free between auto budgets (in
proportion to their expert bytes, none beyond its own experts, leftovers to the others). In one
process, `LEDGER` records the streamed models loaded here, so a second `load` counts what the
first holds and closing one lets the others' auto budgets grow."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from .errors import BudgetError, SettingsError
from .memory_limit import MemoryLimit, memory_limit
from .settings import GIB, MAX_GIB

# Kept free beside the slots, the trunk, the KV cache and MLX's buffer cache: the process
# itself (Python, MLX, mlx-lm and the tokenizer take about 0.5 GB here), a prefill chunk's
# activations and the sweep's scratch buffers, and the allocator's slack.
HEADROOM_GIB = 1.0


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class AutoBudget:
    """What auto picks for one model, and why: the limit minus each term."""

    model: str  # the model's folder or entry, for messages
    limit: MemoryLimit
    terms: tuple  # Term, in the order they are subtracted
    expert_bytes: int  # every routed expert of the model: more would never be used
    smallest: int  # one token's experts in every MoE layer
    share_note: str = ""  # how the free memory was split with other auto models, if it was
    split: int | None = None  # this model's part of what several auto models share (`share`)

    @property
    def free(self) -> int:
        return self.limit.bytes - sum(t.bytes for t in self.terms)

    @property
    def bytes(self) -> int:
        return self.split if self.split is not None else min(self.free, self.expert_bytes)

    def check(self) -> "AutoBudget":
        if self.free < self.smallest:
            raise BudgetError(self.refusal())
        return self

    def refusal(self) -> str:
        taken = ", ".join(f"{t.name} {t.bytes / GIB:.3f} GiB" + (f" ({t.note})" if t.note else "") for t in self.terms)
        return (f"{self.model}: budget_gib auto leaves {max(self.free, 0) / GIB:.3f} GiB for expert slots, below the "
                f"smallest budget of {self.smallest / GIB:.4f} GiB (one token's experts in every MoE layer): the "
                f"limit is {self.limit.bytes / GIB:.2f} GiB ({self.limit.source}), taken by {taken}; free memory (a "
                "smaller context_length, fewer models), raise the limit (memory_gib), or set a budget_gib number "
                "and accept the risk")

    def with_others(self, others: int, names: str, note: str = "") -> "AutoBudget":
        """The same budget with another term: memory the other models take."""
        return AutoBudget(self.model, self.limit, self.terms + (Term("other models", others, names),),
                          self.expert_bytes, self.smallest, note)

    def lines(self) -> list[str]:
        """The breakdown, one term a line (plan and the logs print it)."""
        out = [f"limit        {self.limit.bytes / GIB:10.4f} GiB  {self.limit.source}"]
        out += [f"- {t.name:<11}{t.bytes / GIB:10.4f} GiB" + (f"  {t.note}" if t.note else "") for t in self.terms]
        out.append(f"= free       {self.free / GIB:10.4f} GiB")
        if self.free < self.smallest:
            out.append(f"budget             none: below the smallest, {self.smallest / GIB:.4f} GiB")
            return out
        cap = " (every expert)" if self.bytes == self.expert_bytes else ""
        out.append(f"budget       {self.bytes / GIB:10.4f} GiB{cap}; experts {self.expert_bytes / GIB:.4f} GiB, "
                   f"smallest {self.smallest / GIB:.4f} GiB" + (f"; {self.share_note}" if self.share_note else ""))
        return out

    def as_dict(self) -> dict:
        return {"budget_gib": round(self.bytes / GIB, 4), "budget_bytes": self.bytes, "auto": True,
                "limit_gib": round(self.limit.bytes / GIB, 3), "limit_source": self.limit.source,
                "terms": [{"name": t.name, "gib": round(t.bytes / GIB, 4), "note": t.note} for t in self.terms],
                "free_gib": round(self.free / GIB, 4), "expert_gib": round(self.expert_bytes / GIB, 4),
                "smallest_gib": round(self.smallest / GIB, 4), "share": self.share_note}


@dataclass(frozen=True)
class ProcessMemory:
    """What an auto budget resolved in this process is sized against: the limit (`memory_gib`
    overrides the one found) and the headroom."""

    memory_gib: float | None = None
    headroom_gib: float = HEADROOM_GIB

    def __post_init__(self):
        for name, low in (("memory_gib", 0.001), ("headroom_gib", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not low <= value <= MAX_GIB):
                raise SettingsError(f"{name} must be a number of GiB between {low} and {MAX_GIB}, got {value!r}")

    def limit(self) -> MemoryLimit:
        override = None if self.memory_gib is None else int(self.memory_gib * GIB)
        return memory_limit(override, "memory_gib")


@dataclass(frozen=True)
class HandedBudget:
    """An auto budget a host resolved for all the models it holds, handed to the loader with
    the entry's settings."""

    bytes: int
    explained: dict | None = None  # AutoBudget.as_dict() of the resolution, for status
    shared: bool = False  # models loaded beside it later take memory from it: keep layers resizable


def model_terms(footprint, context_length: int) -> tuple:
    """What one streamed model holds besides its slots: its trunk and its KV cache."""
    kv = footprint.kv
    return (Term("trunk", footprint.trunk_bytes, "the checkpoint's tensors besides routed experts"),
            Term("KV cache", kv.bytes_for(context_length), kv.describe(context_length)))


def process_terms(mlx_cache_limit_gib: float, headroom_gib: float, headroom_source: str = "") -> tuple:
    """What a process holds besides its models: MLX's buffer cache (its cap) and the headroom."""
    return (Term("MLX cache", int(mlx_cache_limit_gib * GIB), "mlx_cache_limit_gib"),
            Term("headroom", int(headroom_gib * GIB), headroom_source or "the process, prefill temporaries"))


def alone(name: str, footprint, settings, limit: MemoryLimit, headroom_gib: float = HEADROOM_GIB,
          context_length: int | None = None) -> AutoBudget:
    """Auto for a model with the process to itself."""
    terms = model_terms(footprint, context_length or settings.context_length)
    terms += process_terms(settings.mlx_cache_limit_gib, headroom_gib)
    return AutoBudget(name, limit, terms, footprint.expert_bytes, footprint.min_budget_bytes)


def share(free: int, models: list[tuple[int, int]]) -> list[int]:
    """Split `free` bytes between models given as (expert bytes, smallest budget): each gets its
    smallest, the rest goes in proportion to what each could still use, none beyond its own
    experts, what one cannot use to the others. Raises BudgetError(index) when the smallest
    budgets alone do not fit: `exc.args[1]` is the first model that does not fit."""
    floors = [min(s, e) for e, s in models]
    spent = 0
    for i, floor in enumerate(floors):
        spent += floor
        if spent > free:
            raise BudgetError(f"the smallest budgets do not fit in {free / GIB:.3f} GiB", i)
    out = list(floors)
    left = free - spent
    open_ = [i for i, (e, _) in enumerate(models) if e > out[i]]
    while left > 0 and open_:
        room = {i: models[i][0] - out[i] for i in open_}
        total = sum(room.values())
        if total <= left:  # everyone gets every expert
            for i in open_:
                out[i] += room[i]
            left -= total
            break
        portion = {i: left * room[i] // total for i in open_}
        for i in open_:
            out[i] += portion[i]
        left -= sum(portion.values())
        open_ = [i for i in open_ if models[i][0] > out[i]]
        if not any(portion.values()):
            break
    for i in open_:  # the bytes of rounding
        extra = min(left, models[i][0] - out[i])
        out[i] += extra
        left -= extra
    return out


class Ledger:
    """The streamed models this process holds: what each takes besides its slots, and its live
    budget. The loader adds a model after it loads; `StreamHandle.close` removes it, and the
    others' auto budgets grow into what it freed."""

    def __init__(self):
        self._lock = threading.Lock()
        # handle -> bytes it holds besides its slots (trunk, KV reserve); a handle dropped without
        # close() leaves with its model
        self._held = weakref.WeakKeyDictionary()
        self._stock: dict[str, int] = {}  # name -> bytes of a model held whole beside (a draft model)

    def add(self, handle, fixed_bytes: int) -> None:
        with self._lock:
            self._held[handle] = fixed_bytes

    def hold_stock(self, name: str, nbytes: int) -> None:
        """A model loaded whole in this process (0 bytes: no longer held)."""
        with self._lock:
            if nbytes:
                self._stock[name] = nbytes
            else:
                self._stock.pop(name, None)

    def others(self, handle=None) -> tuple[int, str]:
        """(bytes, names) the models other than `handle` hold: trunk, KV reserve and budget, and
        the models held whole."""
        with self._lock:
            held = [(h, b) for h, b in list(self._held.items()) if h is not handle]
            stock = dict(self._stock)
        return (sum(b + h.budget.target_bytes for h, b in held) + sum(stock.values()),
                ", ".join([h.model_path.name for h, _ in held] + list(stock)))

    def remove(self, handle) -> None:
        """`handle` is closed: split what it held between the auto budgets left (grow only)."""
        with self._lock:
            fixed = self._held.pop(handle, None)
            growing = [h for h in list(self._held) if h.budget.auto]
        if fixed is None or not growing:
            return
        freed = fixed + handle.budget.target_bytes
        more = share(freed, [(h.budget.expert_bytes - h.budget.target_bytes, 0) for h in growing])
        for h, extra in zip(growing, more):
            if extra:
                h.set_budget(h.budget.target_bytes + extra)


LEDGER = Ledger()
