"""The layers of the code: the runtime engine (streaming/) imports neither the lab
(streaming/lab/) nor the plugin (plugin/); the lab may import the runtime, never the plugin; the
user's side of the plugin takes only the lab's public names, and none of the lab's commands."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved)."""
    package = ["expert_stream", *path.relative_to(ROOT).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def files(folder: str, exclude: str | None = None) -> list[Path]:
    out = sorted((ROOT / folder).rglob("*.py"))
    return [p for p in out if exclude is None or not p.is_relative_to(ROOT / exclude)]


@pytest.mark.parametrize("path", files("streaming", exclude="streaming/lab"), ids=lambda p: p.name)
def test_runtime_imports_neither_lab_nor_plugin(path):
    bad = sorted(m for m in imported_modules(path)
                 if m.startswith(("expert_stream.streaming.lab", "expert_stream.plugin")))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", files("streaming/lab"), ids=lambda p: str(p.relative_to(ROOT / "streaming/lab")))
def test_lab_does_not_import_the_plugin(path):
    bad = sorted(m for m in imported_modules(path) if m.startswith("expert_stream.plugin"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", files("plugin", exclude="plugin/cli/lab"), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_code_takes_only_public_lab_names(path):
    """What the user's commands need of the lab is a public function of it, and the lab's
    commands (plugin/cli/lab/) are not a library for them."""
    bad = sorted(m for m in imported_modules(path)
                 if m.startswith("expert_stream.plugin.cli.lab")
                 or m.startswith("expert_stream.streaming.lab") and any(p.startswith("_") for p in m.split(".")))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
