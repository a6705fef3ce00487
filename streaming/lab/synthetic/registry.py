"""Every family's preset by name (`PRESETS`): the first file's (presets.py), then the 2026
flagships and the older families added with them (presets_2026.py)."""

from __future__ import annotations

from .errors import SyntheticError
from .preset import Preset
from .presets import FIRST_PRESETS
from .presets_2026 import PRESETS_2026

PRESETS: dict[str, Preset] = {**FIRST_PRESETS, **{p.name: p for p in PRESETS_2026}}


def all_architectures() -> tuple[str, ...]:
    """Preset names whose mlx-lm model module exists in the installed mlx-lm."""
    return tuple(name for name, p in PRESETS.items() if p.available())


def get_preset(arch: str) -> Preset:
    try:
        preset = PRESETS[arch]
    except KeyError:
        raise SyntheticError(
            f"unknown architecture {arch!r}; synthetic checkpoints exist for: "
            f"{', '.join(sorted(PRESETS))}"
        ) from None
    if not preset.available():
        import mlx_lm

        raise SyntheticError(
            f"architecture {arch!r} needs mlx_lm.models.{preset.module or arch}, which "
            f"mlx-lm {mlx_lm.__version__} does not have; upgrade mlx-lm or pick another"
        )
    return preset
