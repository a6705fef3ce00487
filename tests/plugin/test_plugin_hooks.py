"""The plugin manager with real plugins: inline objects, and one installed through an entry point."""

from __future__ import annotations

import sys
import textwrap

import pluggy
import pytest

from expert_stream import hookimpl
from expert_stream.plugin import plugins
from expert_stream.plugin.plugins import DEFAULT_PLUGINS, make_plugin_manager
from expert_stream.streaming.architectures import ArchitectureSpec, spec_for
from expert_stream.streaming.errors import SettingsError


@pytest.fixture(autouse=True)
def _fresh_manager(monkeypatch):
    monkeypatch.delenv("EXPERT_STREAM_PLUGINS", raising=False)
    monkeypatch.delenv("EXPERT_STREAM_BLOCK_PLUGINS", raising=False)
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A distribution on sys.path whose `expert_stream` entry point registers an architecture."""
    (tmp_path / "toy_es_plugin.py").write_text(textwrap.dedent("""
        from expert_stream import hookimpl
        from expert_stream.streaming.architectures import ArchitectureSpec

        TOY = ArchitectureSpec(name="toy", model_types=("toy_moe",), notes="from an entry point")

        @hookimpl
        def register_architectures(register):
            register(TOY)
    """))
    dist = tmp_path / "toy_es_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-es-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[expert_stream]\ntoy = toy_es_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "toy"
    sys.modules.pop("toy_es_plugin", None)


def test_builtins_are_registered_as_plugins():
    pm = make_plugin_manager(entry_points=False)
    assert set(DEFAULT_PLUGINS) <= set(plugins.plugin_names(pm))
    specs = plugins.architectures(pm)
    assert spec_for("qwen3_moe", specs).name == "qwen3_moe"
    assert spec_for("deepseek_v3", specs).name == "deepseek"
    assert set(plugins.hosts(pm)) == {"mlx-openai-server", "mlx_lm.server"}


def test_inline_plugin_registers_several_architectures_and_wins_over_builtin():
    class TwoSpecs:
        @hookimpl
        def register_architectures(self, register):
            register(ArchitectureSpec(name="mine-a", model_types=("brand_new_moe",)))
            register(ArchitectureSpec(name="mine-b", model_types=("qwen3_moe",)))

    pm = make_plugin_manager(entry_points=False)
    pm.register(TwoSpecs(), name="two-specs")
    specs = plugins.architectures(pm)
    assert spec_for("brand_new_moe", specs).name == "mine-a"
    assert spec_for("qwen3_moe", specs).name == "mine-b"  # registered later, called first


def test_entry_point_plugin_loads_and_env_vars_allow_or_block_it(installed_plugin, monkeypatch):
    specs = plugins.architectures(make_plugin_manager())
    assert spec_for("toy_moe", specs).notes == "from an entry point"

    monkeypatch.setenv("EXPERT_STREAM_PLUGINS", "")
    assert spec_for("toy_moe", plugins.architectures(make_plugin_manager())).name == "generic"
    monkeypatch.setenv("EXPERT_STREAM_PLUGINS", "toy")
    assert spec_for("toy_moe", plugins.architectures(make_plugin_manager())).name == "toy"

    monkeypatch.delenv("EXPERT_STREAM_PLUGINS")
    monkeypatch.setenv("EXPERT_STREAM_BLOCK_PLUGINS", "toy")
    assert spec_for("toy_moe", plugins.architectures(make_plugin_manager())).name == "generic"


def test_blocking_a_builtin(monkeypatch):
    monkeypatch.setenv("EXPERT_STREAM_BLOCK_PLUGINS", "expert_stream.plugin.default_plugins.architectures")
    pm = make_plugin_manager(entry_points=False)
    assert "expert_stream.plugin.default_plugins.architectures" not in plugins.plugin_names(pm)
    assert plugins.architectures(pm) == []


def test_unknown_hook_is_refused_by_check_pending():
    class Typo:
        @hookimpl
        def register_architecture(self, register):  # missing "s"
            pass

    pm = make_plugin_manager(entry_points=False)
    pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_validate_settings_plugin_refuses_before_loading(checkpoints_plugin):
    import expert_stream

    class NoTinyBudgets:
        @hookimpl
        def validate_settings(self, settings, model_path, where):
            if settings.budget_gib < 1:
                raise SettingsError(f"{where}: budget_gib below 1 GiB is refused by site policy")

    pm = plugins.get_plugin_manager()
    pm.register(NoTinyBudgets())
    with pytest.raises(SettingsError, match="refused by site policy"):
        expert_stream.load(checkpoints_plugin["moe"], budget_gib=0.001)


def test_load_goes_through_the_manager_and_matches_stock(checkpoints_plugin):
    import mlx_lm

    import expert_stream
    from plugin_fixtures import ENGINE_SETTINGS

    seen = []

    class Observer:
        @hookimpl
        def model_loaded(self, model_id, model_path, handle):
            seen.append((model_path, handle))

    plugins.get_plugin_manager().register(Observer())
    path = checkpoints_plugin["moe"]
    model, tokenizer, handle = expert_stream.load(path, budget_gib=0.00005, **ENGINE_SETTINGS)
    stock, stock_tokenizer = mlx_lm.load(str(path))
    prompt = "the experts stream from disk"
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=16) == \
        mlx_lm.generate(stock, stock_tokenizer, prompt, max_tokens=16)
    assert seen and seen[0][1] is handle
    assert handle.stats()["totals"]["misses"] > 0
    handle.close()


def test_detect_moe_plugin_overrides_builtin(checkpoints_plugin):
    from expert_stream.streaming.checkpoint import CheckpointIndex

    pm = plugins.get_plugin_manager()
    assert pm.hook.detect_moe(index=CheckpointIndex(checkpoints_plugin["moe"])) is True
    assert pm.hook.detect_moe(index=CheckpointIndex(checkpoints_plugin["dense"])) is False

    class NothingIsMoE:
        @hookimpl
        def detect_moe(self, index):
            return False

    pm.register(NothingIsMoE())
    assert pm.hook.detect_moe(index=CheckpointIndex(checkpoints_plugin["moe"])) is False
    import expert_stream
    from expert_stream.streaming.errors import NotMoEError

    with pytest.raises(NotMoEError, match="no detect_moe plugin found experts"):  # the Python API asks it too
        expert_stream.load(checkpoints_plugin["moe"], budget_gib=1)


@pytest.fixture(scope="module")
def checkpoints_plugin(tmp_path_factory):
    from plugin_fixtures import make_dense, make_moe

    root = tmp_path_factory.mktemp("hook-checkpoints")
    return {"moe": make_moe(root), "dense": make_dense(root)}
