"""Loading: build the stock mlx-lm model lazily, swap every routed-expert block for a streamed
one before anything is evaluated, then evaluate the trunk. Expert tensors never materialize:
the lazy arrays `mlx_lm.utils.load_model(lazy=True)` made for them are dropped unevaluated.

`load_streamed` is the one load path: the library (`load`), the hosts (a host's own
`load_model` call, intercepted, passes it as `build`) and pipeline ranks all go through it, and
it runs the one list of checks (load_checks.py) before anything loads."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import footprint as footprints
from .architectures import find_expert_blocks, spec_for
from .auto_budget import HEADROOM_GIB, LEDGER, HandedBudget, ProcessMemory, alone
from .budget import HitCurve, LayerPlan, plan_layers
from .cache import ExpertCache, LayerStats
from .checkpoint import CheckpointIndex, NeededTensors
from .errors import NotMoEError, SettingsError
from .handle import ModelBudget, StreamHandle
from .load_checks import LoadHooks, check_budget, check_checkpoint
from .reader import ExpertReader
from .remote_code import trusted
from .settings import GIB, StreamSettings
from .slots import ExpertSlots, resolve_slot_write
from .expert_layout import expert_tensors
from .expert_store import ExpertStore
from .lookahead import Lookahead, make_probe, module_at, resolve_prefetch
from .lossy import MissSkipper, override_top_k
from .native_decode import link_native
from .native_check import native_module
from .online_budget import OnlineBudget
from .guess_buffer import GuessPool
from .prefill_sweep import ScratchPool
from .streamed_switch import StreamedSwitch
from .traces import load_trace
from .warm_start import CURVE_TOKENS, lru_hit_curve, preload, preload_all, trace_columns

log = logging.getLogger("expert_stream")


def load(
    path: str | Path,
    budget_gib: float | str | None = None,
    *,
    hooks: LoadHooks = LoadHooks(),
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    pipeline_group=None,
    trust_remote_code: bool = False,
    memory_gib: float | None = None,
    headroom_gib: float = HEADROOM_GIB,
    **settings: Any,
):
    """Load an MLX MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle). The model is a stock mlx-lm model whose expert blocks
    are streamed; use it with `mlx_lm.generate` / `stream_generate` as usual. `handle.stats()`
    reports the budget and the cache counters; `handle.close()` releases the reader.
    `budget_gib` unset or "auto": fit to memory (this process's limit, or `memory_gib`, minus
    the trunk, the KV cache, MLX's cache, the other models loaded here and `headroom_gib`).
    """
    from mlx_lm.utils import load_tokenizer

    where = f"expert_stream.load({str(path)!r})"
    if budget_gib is not None:
        settings["budget_gib"] = budget_gib
    parsed = StreamSettings.from_mapping(settings, where=where)
    model, config, handle = load_streamed(
        path, parsed, hooks=hooks, model_config=model_config, pipeline_group=pipeline_group,
        trust_remote_code=trust_remote_code, where=where,
        memory=ProcessMemory(memory_gib, headroom_gib),
    )
    tokenizer = load_tokenizer(Path(path).expanduser(), tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, handle


def load_streamed(
    path: str | Path,
    settings: StreamSettings,
    *,
    hooks: LoadHooks = LoadHooks(),
    build: Optional[Callable[[], tuple]] = None,
    model_config: dict | None = None,
    pipeline_group=None,
    trust_remote_code: bool = False,
    budget: Optional[HandedBudget] = None,
    memory: ProcessMemory = ProcessMemory(),
    where: str = "",
):
    """The one load path. Runs the load checks, builds the model lazily (`build()` -> (model,
    config): a host's own `load_model`; default mlx-lm's), sizes it, resolves the budget (the
    number set; the one a host resolved for all its models, `budget`; else auto in this
    process), swaps the expert blocks, evaluates the trunk. Returns (model, config, handle).
    With `pipeline_group` (mlx.distributed), this process keeps and streams only the layers
    mlx-lm's pipeline gives its rank, from the shards that hold them."""
    from mlx_lm.utils import load_model

    model_path = Path(path).expanduser()
    where = where or f"{model_path}: expert_stream"
    if build is None:
        def build():
            return load_model(model_path, lazy=True, strict=pipeline_group is None, model_config=model_config,
                              **trusted(load_model, trust_remote_code))

    if pipeline_group is not None:
        return _load_rank(model_path, settings, pipeline_group, hooks, build, trust_remote_code, where, memory)
    index = check_checkpoint(model_path, settings, where, hooks, trust_remote_code)
    model, config = build()
    handle = _attach(model, index, settings, hooks.architectures, budget, where, memory)
    mx.eval(model.parameters())  # the trunk (and any layers left resident); never routed experts
    handle.reader.verify()  # the trunk just read came from the shards the experts will come from
    return model, config, handle


def _load_rank(model_path, settings, group, hooks, build, trust_remote_code, where, memory):
    """This rank's layers, streamed; every rank passes `agree` (the load barrier sharded_load
    has) with its outcome, so a rank that failed fails them all instead of leaving them waiting."""
    from .rank_agreement import agree

    try:
        # A rank may hold only its own layers' shards: check what is here, then index its layers.
        here = NeededTensors(frozenset(), f"rank {group.rank()}")
        check_checkpoint(model_path, settings, where, hooks, trust_remote_code, needed=here)
        model, config = build()
        index, settings = pipeline(model, model_path, settings, group)
        handle = _attach(model, index, settings, hooks.architectures, None, where, memory)
        # A rank's layers wait on the previous rank's send of each chunk: one chunk at a time.
        handle.prefill.keep_per_chunk("a pipeline rank")
        mx.eval(model.parameters())  # this rank's trunk; never routed experts
        handle.reader.verify()
    except Exception as exc:  # any failure: the other ranks must hear of it
        agree(group, exc)
    agree(group, None)
    return model, config, handle


def pipeline(model: nn.Module, model_path: Path, settings: StreamSettings, group):
    """Give this rank its layers (mlx-lm's own `pipeline`), then index only the shards they need.
    Returns (index, this rank's settings)."""
    rank = group.rank()
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise NotMoEError(
            f"{model_path}: mlx-lm has no pipeline mode for model_type "
            f"{type(model).__module__.rsplit('.', 1)[-1]!r}; load it on one machine"
        )
    model.model.pipeline(group)
    needed = NeededTensors(frozenset(k for k, _ in tree_flatten(model.parameters())), f"rank {rank}")
    index = CheckpointIndex(model_path, needed=needed)
    by_rank = settings.budget_gib_by_rank
    if by_rank is not None:
        if len(by_rank) != group.size():
            raise SettingsError(
                f"budget_gib_by_rank has {len(by_rank)} entries for a pipeline of {group.size()} ranks"
            )
        settings = dataclasses.replace(settings, budget_gib=float(by_rank[rank]))
    return index, settings


def _attach(model: nn.Module, index: CheckpointIndex, settings: StreamSettings, architectures,
            handed: Optional[HandedBudget], where: str, memory: ProcessMemory) -> StreamHandle:
    """Swap the routed-expert blocks of a lazily loaded (not yet evaluated) model for streamed
    ones. The caller evaluates the trunk afterwards (`mx.eval(model.parameters())`)."""
    spec = spec_for(index.model_type, architectures)
    blocks = find_expert_blocks(model, spec)
    if not blocks:
        raise NotMoEError(
            f"{index.model_dir}: model_type {index.model_type!r} has no routed-expert layers "
            "(no SwitchGLU / SwitchMLP blocks); load it with mlx_lm.load, there is nothing to stream"
        )
    layouts = [(path, block, expert_tensors(index, path, block, spec)) for path, block in blocks]
    # Sized before any block is swapped: measuring the KV cache calls the stock model lazily.
    fp = footprints.measure(index, model, spec, [tensors for _, _, tensors in layouts])
    budget = _resolve_budget(fp, settings, handed, where, memory)
    if settings.top_k_override is not None:
        override_top_k(model, [path for path, _ in blocks], spec.experts_per_token(index.config), settings.top_k_override)
    if settings.mlx_cache_limit_gib is not None:
        mx.set_cache_limit(int(settings.mlx_cache_limit_gib * GIB))
    top_k = settings.top_k_override or spec.experts_per_token(index.config)
    trace, columns = _warm_start_trace(settings, [path for path, _, _ in layouts])
    curves = None
    if columns is not None and settings.budget_by_trace:
        recent = trace.ids[-CURVE_TOKENS:]
        curves = [lru_hit_curve(recent[:, c], t[0].num_experts) for c, (_, _, t) in zip(columns, layouts)]
    # A budget that others may shrink later keeps every layer streamed: a stock block cannot
    # give its experts back.
    resident = settings.resident and not (handed is not None and handed.shared)
    plans = plan_layers([(path, tensors) for path, _, tensors in layouts], budget.target_bytes, resident, top_k,
                        curves)
    reader = ExpertReader(
        index.files, threads=settings.reader_threads, cache_bypass=settings.cache_bypass,
        backend=settings.reader, identities=index.identities,
    )
    write_mode = resolve_slot_write(settings.slot_write)
    scratch = ScratchPool(write_mode)
    layers = []
    for (path, block, tensors), plan in zip(layouts, plans):
        if plan.resident:
            continue  # stays a stock block; its lazy tensors load with the trunk
        layers.append(_swap(model, path, block, tensors, plan, settings, reader, write_mode, spec, scratch))
    streams = [layer.store for layer in layers]
    native_why = None  # decode_path native: "" where it serves, else why the Python path does
    if settings.decode_path == "native" and not layers:
        native_why = "no expert layer is streamed (all fit the budget): stock's blocks decode"
    elif settings.decode_path == "native":
        module, native_why = native_module()
        if module is not None:
            native_why = link_native(module, layers, index, reader.cache_bypass)
        if native_why:
            log.warning("%s: decode_path native: %s; the Python decode path serves", index.model_dir.name, native_why)
    if resolve_prefetch(settings.prefetch) and native_why != "":
        _link_lookahead(model, layers, spec, top_k, settings)
    full = [s for s in streams if s.cache.num_slots == s.cache.num_experts]
    warm_bytes = preload_all(full)  # a slot for every expert: load them now, as stock would
    if columns is not None:
        by_path = dict(zip([path for path, _, _ in layouts], columns))
        rest = [s for s in streams if s not in full]
        warm_bytes += preload(rest, trace, [by_path[s.name] for s in rest])
    for s in streams:
        s.cache.stats = LayerStats()  # the counters describe serving, not loading
    fixed = sum(p.slot_bytes for p in plans if p.resident)  # stock blocks: their experts stay
    if layers:
        _link_online_budget(layers, full, top_k or 1, budget.target_bytes - fixed, settings.online_budget)
    log.info(
        "%s: streaming %d of %d expert layers, %d slots each, budget %.3f GiB%s",
        index.model_dir.name, len(streams), len(blocks), plans[0].num_slots, budget.target_bytes / GIB,
        " (auto)" if budget.auto else "",
    )
    handle = StreamHandle(index, settings, layers, plans, reader, model, warm_bytes, budget)
    handle.decode_path = ("native" if native_why == "" else "python", native_why or "")
    LEDGER.add(handle, fp.trunk_bytes + fp.kv.bytes_for(budget.context_length))
    handle.prefill.size_by(fp.prefill_token_bytes, partial(_prefill_room, handle, fp.kv, memory))
    return handle


def _prefill_room(handle: StreamHandle, kv, memory: ProcessMemory, tokens: int) -> int:
    """Bytes a prefill of `tokens` may give its activations: the limit, less what the process
    holds now (RSS, or MLX's own count where the device's memory is not in it), the slots the
    budget has yet to allocate, and the prompt's KV cache."""
    import psutil

    held = max(psutil.Process().memory_info().rss, mx.get_active_memory() + mx.get_cache_memory())
    unallocated = max(handle.budget.target_bytes - handle.budget_bytes, 0)
    return memory.limit().bytes - held - unallocated - kv.bytes_for(tokens)


def _resolve_budget(fp, settings: StreamSettings, handed: Optional[HandedBudget], where: str,
                    memory: ProcessMemory) -> ModelBudget:
    """The number set, the one a host resolved for all its models, or auto in this process
    (counting the models loaded here before: the ledger)."""
    def model_budget(nbytes, explained=None):
        return ModelBudget(settings.auto, nbytes, fp.expert_bytes, fp.min_budget_bytes, settings.context_length,
                           explained)

    if handed is not None:
        check_budget(handed.bytes, fp.min_budget_bytes, fp.top_k, len(fp.layer_expert_bytes), where)
        return model_budget(handed.bytes, handed.explained)
    if not settings.auto:
        check_budget(settings.budget_bytes, fp.min_budget_bytes, fp.top_k, len(fp.layer_expert_bytes), where)
        return model_budget(settings.budget_bytes)
    auto = alone(str(fp.model_dir), fp, settings, memory.limit(), memory.headroom_gib)
    others, names = LEDGER.others()
    if others:
        auto = auto.with_others(others, f"loaded in this process: {names}")
    auto.check()
    log.info("%s: budget_gib auto:\n  %s", fp.model_dir.name, "\n  ".join(auto.lines()))
    return model_budget(auto.bytes, auto.as_dict())


def _warm_start_trace(settings, layer_paths):
    """(trace, trace column per MoE layer) of the warm_start setting, or (None, None)."""
    if settings.warm_start is None:
        return None, None
    trace = load_trace(Path(settings.warm_start).expanduser())
    columns = trace_columns(trace, layer_paths)
    if columns is None:
        log.warning(
            "warm_start %s: its layers %s are not this model's MoE layers; ignored",
            settings.warm_start, list(trace.layer_ids),
        )
        return None, None
    return trace, columns


def _swap(model, path, block, tensors, plan: LayerPlan, settings, reader, write_mode, spec, scratch) -> StreamedSwitch:
    slots = ExpertSlots(tensors, plan.num_slots, write_mode)
    block.update(tree_unflatten(list(slots.arrays.items())))  # drops the lazy expert arrays
    cache = ExpertCache(plan.num_experts, plan.num_slots, settings.policy)
    store = ExpertStore(path, cache, slots, reader)
    skipper = None
    if settings.skip_miss_below is not None:
        moe_block = module_at(model, path.rsplit(".", 1)[0])
        skipper = MissSkipper(moe_block, settings.skip_miss_below, spec.router)
    layer = StreamedSwitch(block, store, settings.overlap, skipper, scratch)
    model.update_modules(tree_unflatten([(path, layer)]))
    return layer


def _link_online_budget(layers, full, floor: int, capacity: int, rebalancing: bool) -> None:
    """One OnlineBudget over the streamed layers: it moves their slots when the model's budget
    changes, and, with `rebalancing`, between layers by the hit curves of those that did not
    hold every expert at load."""
    if rebalancing:
        for layer in layers:
            if layer.store not in full:
                layer.store.cache.curve = HitCurve(layer.store.cache.num_experts)
    budget = OnlineBudget(layers, floor, capacity, rebalancing)
    for layer in layers:
        layer.online_budget = budget


def _link_lookahead(model, layers, spec, top_k, settings) -> None:
    """Each streamed layer guesses the experts of the next `prefetch_depth` streamed layers,
    read into side buffers of the model's GuessPool (or, with prefetch_into slots, into the
    guessed layers' slots)."""
    router_hook = spec.router
    pool = GuessPool(settings.prefetch_per_layer * settings.prefetch_depth) if settings.prefetch_into == "buffer" else None
    for i, current in enumerate(layers):
        for depth, later in enumerate(layers[i + 1:i + 1 + settings.prefetch_depth], start=1):
            guesses = settings.prefetch_guesses or top_k or 1
            probe = make_probe(model, current.store.name, later.store.name, guesses, router_hook)
            if probe is None:
                continue
            later.store.guess_pool = pool
            current.lookaheads.append(Lookahead(probe, later.store, settings.prefetch_per_layer, depth))
