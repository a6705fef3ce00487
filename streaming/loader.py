"""Loading: build the stock mlx-lm model lazily, swap every routed-expert block for a streamed
one before anything is evaluated, then evaluate the trunk. Expert tensors never materialize:
the lazy arrays `mlx_lm.utils.load_model(lazy=True)` made for them are dropped unevaluated."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .architectures import ArchitectureSpec, check_streamable, find_expert_blocks, spec_for
from .budget import HitCurve, LayerPlan, plan_layers
from .cache import ExpertCache, LayerStats
from .checkpoint import CheckpointIndex, NeededTensors
from .errors import CheckpointError, NotMoEError, SettingsError
from .handle import StreamHandle
from .reader import ExpertReader
from .remote_code import refuse_model_file, trusted
from .settings import GIB, StreamSettings
from .slots import ExpertSlots, ExpertTensor, resolve_slot_write
from .expert_store import ExpertStore
from .lookahead import Lookahead, make_probe, module_at, resolve_prefetch
from .lossy import MissSkipper, override_top_k
from .online_budget import OnlineBudget
from .prefill_sweep import ScratchPool
from .streamed_switch import StreamedSwitch
from .traces import load_trace
from .warm_start import CURVE_TOKENS, lru_hit_curve, preload, preload_all, trace_columns

log = logging.getLogger("expert_stream")

# Quantization modes MLX's gather_qmm implements and the bit widths affine supports.
QUANT_MODES = {"affine": (2, 3, 4, 5, 6, 8), "mxfp4": (4,), "mxfp8": (8,), "nvfp4": (4,)}


def load(
    path: str | Path,
    budget_gib: float | None = None,
    *,
    architectures: list[ArchitectureSpec] | None = None,
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    trust_remote_code: bool = False,
    **settings: Any,
):
    """Load an MLX MoE checkpoint with its routed experts streamed from disk.

    Returns (model, tokenizer, handle). The model is a stock mlx-lm model whose expert blocks
    are streamed; use it with `mlx_lm.generate` / `stream_generate` as usual. `handle.stats()`
    reports the cache counters; `handle.close()` releases the reader.
    """
    if budget_gib is not None:
        settings["budget_gib"] = budget_gib
    return load_streamed(
        path, StreamSettings.from_mapping(settings, where="expert_stream.load"),
        architectures=architectures, tokenizer_config=tokenizer_config, model_config=model_config,
        trust_remote_code=trust_remote_code,
    )


def load_streamed(
    path: str | Path,
    settings: StreamSettings,
    *,
    architectures: list[ArchitectureSpec] | None = None,
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    index: CheckpointIndex | None = None,
    pipeline_group=None,
    trust_remote_code: bool = False,
):
    """`load` with its settings parsed (and its checkpoint indexed, when `index` is given).
    With `pipeline_group` (mlx.distributed), this process keeps and streams only the layers
    mlx-lm's pipeline gives its rank, from the shards that hold them."""
    from mlx_lm.utils import load_model, load_tokenizer

    model_path = Path(path).expanduser()
    refuse_model_file(model_path, trust_remote_code)  # before mlx-lm can run it
    if pipeline_group is not None:
        model, config, handle = _load_rank(model_path, settings, pipeline_group, architectures, model_config,
                                           trust_remote_code)
    else:
        if index is None:
            index = CheckpointIndex(model_path)  # fails fast on missing or truncated shards
        check_quantization(index)
        model, config = load_model(model_path, lazy=True, model_config=model_config,
                                   **trusted(load_model, trust_remote_code))
        handle = attach(model, index, settings, architectures)
        mx.eval(model.parameters())  # the trunk (and any layers left resident); never routed experts
        handle.reader.verify()  # the trunk just read came from the shards the experts will come from
    tokenizer = load_tokenizer(model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, handle


def _load_rank(model_path, settings, group, architectures, model_config, trust_remote_code):
    """This rank's layers, streamed; every rank passes `agree` (the load barrier sharded_load
    has) with its outcome, so a rank that failed fails them all instead of leaving them waiting."""
    from mlx_lm.utils import load_model

    from .rank_agreement import agree

    try:
        model, config = load_model(model_path, lazy=True, strict=False, model_config=model_config,
                                   **trusted(load_model, trust_remote_code))
        index, settings = pipeline(model, model_path, settings, group)
        handle = attach(model, index, settings, architectures)
        mx.eval(model.parameters())  # this rank's trunk; never routed experts
        handle.reader.verify()
    except Exception as exc:  # any failure: the other ranks must hear of it
        agree(group, exc)
    agree(group, None)
    return model, config, handle


def pipeline(model: nn.Module, model_path: Path, settings: StreamSettings, group):
    """Give this rank its layers (mlx-lm's own `pipeline`), then index only the shards they need.
    Returns (index, this rank's settings)."""
    import dataclasses

    rank = group.rank()
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise NotMoEError(
            f"{model_path}: mlx-lm has no pipeline mode for model_type "
            f"{type(model).__module__.rsplit('.', 1)[-1]!r}; load it on one machine"
        )
    model.model.pipeline(group)
    needed = NeededTensors(frozenset(k for k, _ in tree_flatten(model.parameters())), f"rank {rank}")
    index = CheckpointIndex(model_path, needed=needed)
    check_quantization(index)
    by_rank = settings.budget_gib_by_rank
    if by_rank is not None:
        if len(by_rank) != group.size():
            raise SettingsError(
                f"budget_gib_by_rank has {len(by_rank)} entries for a pipeline of {group.size()} ranks"
            )
        settings = dataclasses.replace(settings, budget_gib=float(by_rank[rank]))
    return index, settings


def attach(
    model: nn.Module,
    index: CheckpointIndex | str | Path,
    settings: StreamSettings,
    architectures: list[ArchitectureSpec] | None = None,
) -> StreamHandle:
    """Swap the routed-expert blocks of a lazily loaded (not yet evaluated) model for streamed
    ones. The caller evaluates the trunk afterwards (`mx.eval(model.parameters())`)."""
    if not isinstance(index, CheckpointIndex):
        index = CheckpointIndex(index)
    check_streamable(index.model_type, index.model_dir)
    spec = spec_for(index.model_type, architectures)
    blocks = find_expert_blocks(model, spec)
    if not blocks:
        raise NotMoEError(
            f"{index.model_dir}: model_type {index.model_type!r} has no routed-expert layers "
            "(no SwitchGLU / SwitchMLP blocks); load it with mlx_lm.load, there is nothing to stream"
        )
    if settings.top_k_override is not None:
        override_top_k(model, [path for path, _ in blocks], spec.experts_per_token(index.config), settings.top_k_override)
    if settings.mlx_cache_limit_gib is not None:
        mx.set_cache_limit(int(settings.mlx_cache_limit_gib * GIB))
    layouts = [(path, block, expert_tensors(index, path, block, spec)) for path, block in blocks]
    top_k = settings.top_k_override or spec.experts_per_token(index.config)
    trace, columns = _warm_start_trace(settings, [path for path, _, _ in layouts])
    curves = None
    if columns is not None and settings.budget_by_trace:
        recent = trace.ids[-CURVE_TOKENS:]
        curves = [lru_hit_curve(recent[:, c], t[0].num_experts) for c, (_, _, t) in zip(columns, layouts)]
    plans = plan_layers(
        [(path, tensors) for path, _, tensors in layouts], settings, top_k, index.model_dir, curves
    )
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
    if resolve_prefetch(settings.prefetch):
        _link_lookahead(model, layers, spec, top_k, settings)
    full = [s for s in streams if s.cache.num_slots == s.cache.num_experts]
    warm_bytes = preload_all(full)  # a slot for every expert: load them now, as stock would
    if columns is not None:
        by_path = dict(zip([path for path, _, _ in layouts], columns))
        rest = [s for s in streams if s not in full]
        warm_bytes += preload(rest, trace, [by_path[s.name] for s in rest])
    for s in streams:
        s.cache.stats = LayerStats()  # the counters describe serving, not loading
    if settings.online_budget:
        _link_online_budget([layer for layer in layers if layer.store not in full], top_k or 1)
    log.info(
        "%s: streaming %d of %d expert layers, %d slots each",
        index.model_dir.name, len(streams), len(blocks), plans[0].num_slots,
    )
    return StreamHandle(index, settings, layers, plans, reader, model, warm_bytes)


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


def _link_online_budget(layers, floor: int) -> None:
    budget = OnlineBudget.for_streams([layer.store for layer in layers], floor)
    if budget is None:
        return
    for layer in layers:
        layer.store.cache.curve = HitCurve(layer.store.cache.num_experts)
        layer.online_budget = budget


def _link_lookahead(model, layers, spec, top_k, settings) -> None:
    """Each streamed layer guesses the experts of the next streamed layer."""
    router_hook = spec.router
    for current, nxt in zip(layers, layers[1:]):
        probe = make_probe(model, current.store.name, nxt.store.name, top_k or 1, router_hook)
        if probe is not None:
            current.lookahead = Lookahead(probe, nxt.store, settings.prefetch_per_layer)


def expert_tensors(index: CheckpointIndex, path: str, block: nn.Module, spec: ArchitectureSpec):
    """The checkpoint tensors behind a block's stacked expert parameters, checked against the
    model's shapes. Other parameters a block holds stay with the trunk (muse_spark keeps a
    norm, `experts.post_expert_norm`, inside its SwitchGLU). A plugin's block class without
    stacked linears streams all its parameters."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    stacked = {p for p, m in block.named_modules() if isinstance(m, (SwitchLinear, QuantizedSwitchLinear))}
    tensors = []
    for leaf, param in tree_flatten(block.parameters()):
        if stacked and leaf.rpartition(".")[0] not in stacked:
            continue
        full = f"{path}.{leaf}"
        info = index.find(full, spec.key_candidates(full))
        if info is None:
            unstacked = index.unstacked_experts_near(path)
            if unstacked:
                raise CheckpointError(
                    f"{index.model_dir}: experts are not stacked (found {unstacked[0]}, ...); "
                    "streaming needs the layout mlx_lm.convert writes: convert the checkpoint first"
                )
            raise CheckpointError(f"{index.model_dir}: tensor {full} not found in any shard")
        if tuple(info.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{index.files[info.file]}: tensor {info.name} has shape {list(info.shape)}, "
                f"the model expects {list(param.shape)}"
            )
        tensors.append(ExpertTensor(leaf, info))
    return tensors


def check_quantization(index: CheckpointIndex) -> None:
    """Refuse quantization MLX cannot run, naming config.json and the entry, before mlx-lm
    builds the model (where the failure would be an unexplained kernel error)."""
    quant = index.config.get("quantization")
    if not isinstance(quant, dict):
        return
    entries = [("quantization", quant)]
    entries += [(f"quantization[{k!r}]", v) for k, v in quant.items() if isinstance(v, dict)]
    for where, entry in entries:
        bits = entry.get("bits")
        if bits is None:
            continue
        mode = entry.get("mode", "affine")  # as nn.quantize: a per-path entry does not inherit
        if mode not in QUANT_MODES or bits not in QUANT_MODES[mode]:
            raise CheckpointError(
                f"{index.model_dir / 'config.json'}: {where} asks for mode={mode} bits={bits}, "
                "which MLX cannot run (supported: "
                + "; ".join(f"{m} bits {', '.join(map(str, b))}" for m, b in QUANT_MODES.items())
                + ")"
            )
