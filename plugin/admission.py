"""Memory admission of a host config: every model must fit before anything loads, and every
`budget_gib: auto` entry gets its number here (streaming/auto_budget.py says how).

A streamed entry holds its trunk, the KV cache of its context length, its process's MLX buffer
cache and its slots; every entry keeps the headroom beside it (each model runs in a process of
its own in mlx-openai-server). A host that holds all its models at once (mlx-openai-server)
splits what is free between its auto entries, in proportion to their expert bytes; one that
holds one model at a time (mlx_lm.server) sizes each against the whole limit."""

from __future__ import annotations

from typing import Optional

from expert_stream.streaming.auto_budget import AutoBudget, HandedBudget, Term, model_terms, process_terms, share
from expert_stream.streaming.errors import BudgetError
from expert_stream.streaming.memory_limit import MemoryLimit, memory_limit
from expert_stream.streaming.settings import GIB

class AdmissionError(BudgetError):
    """A config whose models do not fit in memory (config.py reports it as the file's error)."""


def limit_of(options, memory_bytes: Optional[int] = None) -> MemoryLimit:
    """The config's `memory_gib`, else the caller's number (tests), else what this process may use."""
    if options.memory_gib is not None:
        return MemoryLimit(int(options.memory_gib * GIB), "expert_stream.memory_gib")
    if memory_bytes is not None:
        return MemoryLimit(memory_bytes, "the caller's memory_bytes")
    return memory_limit()


def own_terms(entry, options) -> tuple:
    """What an entry's process holds besides its slots (a dense entry: the whole model)."""
    headroom = process_terms(0, options.headroom_gib, "expert_stream.headroom_gib")[1:]
    draft = (Term("draft model", entry.draft_bytes, "draft_model_path, loaded whole"),) if entry.draft_bytes else ()
    if not entry.streamed:
        return (Term("model", entry.resident_bytes, "the whole model, not streamed"),) + draft + headroom
    if entry.footprint is None:  # sizes unknown (the checkpoints were not read)
        return draft + headroom
    return (model_terms(entry.footprint, entry.settings.context_length) + draft
            + process_terms(entry.settings.mlx_cache_limit_gib, options.headroom_gib, "expert_stream.headroom_gib"))


def admit(config, memory_bytes: Optional[int] = None) -> None:
    """Resolve every auto entry's budget (`entry.budget`) and refuse, by name, the first entry
    that does not fit, before anything loads."""
    limit = limit_of(config.options, memory_bytes)
    together = not config.schema.one_model_at_a_time
    terms = {e.model_id: own_terms(e, config.options) for e in config.entries}
    fixed = {e.model_id: sum(t.bytes for t in terms[e.model_id]) + _fixed_slots(e) for e in config.entries}
    autos = [e for e in config.entries if e.streamed and e.settings.auto and e.footprint is not None]
    used = 0
    for entry in config.entries:  # file order: the first entry that does not fit is named
        others = used if together else 0
        need = fixed[entry.model_id] + (entry.footprint.min_budget_bytes if entry in autos else 0)
        if others + need > limit.bytes:
            raise AdmissionError(f"{config.path}: {_refusal(entry, limit, terms[entry.model_id], others)}")
        used += need
    if not autos:
        return _record(config, fixed)
    if together:
        free = limit.bytes - sum(fixed.values())
        try:
            budgets = share(free, [(e.footprint.expert_bytes, e.footprint.min_budget_bytes) for e in autos])
        except BudgetError as exc:  # the walk above already refuses this; kept for a clear message
            entry = autos[exc.args[1]]
            raise AdmissionError(f"{config.path}: {_refusal(entry, limit, terms[entry.model_id], used)}") from None
    else:
        budgets = [limit.bytes - fixed[e.model_id] for e in autos]
    note = (f"the free memory split between {len(autos)} auto entries by their expert bytes" if together
            else "one model at a time: each sized alone")
    for entry, nbytes in zip(autos, budgets):
        nbytes = min(nbytes, entry.footprint.expert_bytes)
        why = terms[entry.model_id]
        if together:
            others = sum(fixed[e.model_id] for e in config.entries if e is not entry)
            others += sum(b for e, b in zip(autos, budgets) if e is not entry)
            why += (Term("other models", others, ", ".join(e.model_id for e in config.entries if e is not entry)
                         or "none"),)
        explained = AutoBudget(_name(entry), limit, why, entry.footprint.expert_bytes,
                               entry.footprint.min_budget_bytes, note, split=nbytes).as_dict()
        entry.budget = HandedBudget(nbytes, explained, shared=together)
    _record(config, fixed)


def _fixed_slots(entry) -> int:
    """Slots of a budget set as a number (never more than the model's experts)."""
    if not entry.streamed or entry.settings.auto or entry.footprint is None:
        return 0
    return min(entry.settings.budget_bytes, entry.footprint.expert_bytes)


def _record(config, fixed: dict) -> None:
    """Each entry's memory, for `room_for_both` (headroom apart, as it adds it)."""
    for entry in config.entries:
        slots = entry.budget.bytes if entry.budget is not None else 0
        entry.resident_bytes = fixed[entry.model_id] - int(config.options.headroom_gib * GIB) + slots


def _name(entry) -> str:
    return f"models[{entry.index}] ({entry.model_id})"


def _refusal(entry, limit: MemoryLimit, terms: tuple, others: int) -> str:
    taken = ", ".join(f"{t.name} {t.bytes / GIB:.3f} GiB" for t in terms)
    if entry.streamed and entry.settings.auto and entry.footprint is not None:
        smallest = f" and the smallest budget {entry.footprint.min_budget_bytes / GIB:.4f} GiB"
        hint = ("free memory (a smaller context_length, fewer models), raise expert_stream.memory_gib if the "
                "machine has more, or remove a model")
    elif entry.streamed:
        smallest = f" and budget_gib {entry.settings.budget_gib} GiB"
        hint = "lower its budget_gib (or set it to auto) or remove a model"
    else:
        smallest = ""
        hint = "stream it with an expert_stream block, or remove a model"
    return (f"{_name(entry)} does not fit in memory: it needs {taken}{smallest}, the models before it take "
            f"{others / GIB:.2f} GiB, and the limit is {limit.bytes / GIB:.2f} GiB ({limit.source}); {hint}")


def room_for_both(config, old, memory_bytes: Optional[int] = None) -> bool:
    """Whether `old` (an entry of the applied config) can stay loaded while all of `config`
    is: then a changed entry loads its new model before the old one is unloaded."""
    headroom = int(config.options.headroom_gib * GIB)
    used = sum(e.resident_bytes + headroom for e in config.entries)
    return used + old.resident_bytes + headroom <= limit_of(config.options, memory_bytes).bytes
