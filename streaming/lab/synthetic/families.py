"""The MoE families of the installed mlx-lm, found in its own model files: a module of
`mlx_lm.models` that builds its experts from `switch_layers` (SwitchGLU / SwitchMLP) is a family
with stacked routed experts. Read as text, nothing imported, so a model file that fails to import
is still counted. The tests hold every family found here to a synthetic preset: the day a new
mlx-lm ships a family, a test names it."""

from __future__ import annotations

import re
from pathlib import Path

_USES_SWITCH = re.compile(r"\b(SwitchGLU|SwitchMLP)\b")


def models_dir() -> Path:
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


def switch_families() -> tuple[str, ...]:
    """Module names (= model_type of their configs) of mlx_lm.models that use SwitchGLU or
    SwitchMLP, sorted."""
    out = []
    for path in sorted(models_dir().glob("*.py")):
        if path.stem in ("switch_layers", "__init__"):
            continue
        if _USES_SWITCH.search(path.read_text(encoding="utf-8", errors="replace")):
            out.append(path.stem)
    return tuple(out)
