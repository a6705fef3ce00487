"""The MoE families of the installed mlx-lm, found in its own model files: a module of
`mlx_lm.models` that builds its experts from `switch_layers` (SwitchGLU / SwitchMLP) is a family
with stacked routed experts, and so is a module that builds on one (imports from it: GLM-5's
glm_moe_dsa is the deepseek_v32 model, solar_open the glm4_moe one). Read as text, nothing
imported, so a model file that fails to import is still counted. The tests hold every family
found here to a synthetic preset: the day a new mlx-lm ships a family, a test names it."""

from __future__ import annotations

import re
from pathlib import Path

_USES_SWITCH = re.compile(r"\b(SwitchGLU|SwitchMLP)\b")
_IMPORTS = re.compile(r"^from \.(\w+) import|^from \. import (\w+)", re.M)


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


def moe_families() -> tuple[str, ...]:
    """switch_families() and every module that imports from one of them, sorted."""
    found = set(switch_families())
    sources = {p.stem: p.read_text(encoding="utf-8", errors="replace")
               for p in models_dir().glob("*.py") if p.stem not in ("switch_layers", "__init__")}
    grown = True
    while grown:  # qwen3_5_moe builds on qwen3_5, which builds on qwen3_next
        grown = False
        for name, text in sources.items():
            if name not in found and any(a in found or b in found for a, b in _IMPORTS.findall(text)):
                found.add(name)
                grown = True
    return tuple(sorted(found))
