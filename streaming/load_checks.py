"""The one list of checks a streamed load runs before anything loads, in order:

1. code shipped in the checkpoint folder is refused unless trusted (remote_code.py);
2. the folder is a checkpoint whose shards are all there (CheckpointIndex);
3. its family can stream (architectures.UNSTREAMABLE);
4. it has routed experts (the `detect_moe` hook when the plugin layer gives one);
5. its quantization is one MLX can run;
6. the settings fit it (top_k_override) and the `validate_settings` hook accepts them;
7. after sizing: the budget holds at least one token's experts in every MoE layer (`check_budget`).

The loader (library, servers, pipeline ranks), config validation and `plan` all run this list.
The plugin layer's hooks arrive as plain callables (`LoadHooks`): the engine imports no plugin."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .architectures import check_streamable, spec_for
from .checkpoint import CheckpointIndex, NeededTensors
from .errors import BudgetError, CheckpointError, NotMoEError, SettingsError
from .remote_code import refuse_model_file
from .settings import GIB, StreamSettings

# Quantization modes MLX's gather_qmm implements and the bit widths affine supports.
QUANT_MODES = {"affine": (2, 3, 4, 5, 6, 8), "mxfp4": (4,), "mxfp8": (8,), "nvfp4": (4,)}


@dataclass(frozen=True)
class LoadHooks:
    """What the plugin layer adds to a load: registered architectures, and its `detect_moe` and
    `validate_settings` hooks. Without them the engine's own rules apply."""

    architectures: Optional[list] = None
    detect_moe: Optional[Callable[[CheckpointIndex], bool]] = None
    validate_settings: Optional[Callable[[StreamSettings, str, str], None]] = None


def check_checkpoint(model_dir: str | Path, settings: Optional[StreamSettings], where: str,
                     hooks: LoadHooks = LoadHooks(), trust_remote_code: bool = False,
                     needed: Optional[NeededTensors] = None) -> CheckpointIndex:
    """Checks 1-6; returns the checkpoint's index. `settings` None: the checkpoint alone (plan).
    `needed`: a pipeline rank, whose folder may hold only its own layers' shards."""
    model_dir = Path(model_dir).expanduser()
    refuse_model_file(model_dir, trust_remote_code)  # before mlx-lm can run it
    index = CheckpointIndex(model_dir, needed=needed)  # fails fast on missing or truncated shards
    check_streamable(index.model_type, index.model_dir)  # a family that cannot stream says so first
    if hooks.detect_moe is not None and not hooks.detect_moe(index):
        raise NotMoEError(
            f"{index.model_dir}: model_type {index.model_type!r} is not an MoE checkpoint: it has no routed-expert "
            "layers (no detect_moe plugin found experts to stream); load it with mlx_lm.load, or serve it "
            "without its expert_stream block"
        )
    check_quantization(index)
    if settings is not None:
        top_k = spec_for(index.model_type, hooks.architectures).experts_per_token(index.config)
        if settings.top_k_override is not None and top_k and settings.top_k_override > top_k:
            raise SettingsError(f"{where}.top_k_override: {settings.top_k_override} is more than the {top_k} experts "
                                f"per token that {index.model_dir}/config.json routes to; the override can only lower it")
        if hooks.validate_settings is not None:
            hooks.validate_settings(settings, str(model_dir), where)
    return index


def check_budget(budget_bytes: int, smallest: int, top_k: Optional[int], moe_layers: int, where: str) -> None:
    """Check 7, for a budget set as a number (an auto budget refuses itself: AutoBudget.check)."""
    if budget_bytes < smallest:
        raise BudgetError(f"{where}.budget_gib: {budget_bytes / GIB:g} GiB cannot hold one token's experts "
                          f"({top_k or 1} per layer in {moe_layers} MoE layers); the smallest budget is "
                          f"{smallest / GIB:.4g} GiB: raise budget_gib, or set it to auto")


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
