"""The config schema: every refusal names the file, the entry and the key; what the host sees."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from expert_stream.plugin.config import ConfigError, load_host_config
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from expert_stream.plugin.reload import FileWatcher
from plugin_fixtures import make_dense, make_moe, needs_openai_server

GIB = 1 << 30


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("config-checkpoints")
    return {"moe": make_moe(root), "dense": make_dense(root)}


@pytest.fixture(scope="module")
def openai_schema():
    needs_openai_server()
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    return MLX_OPENAI_SERVER.schema()


def write(tmp_path, text: str):
    path = tmp_path / "host.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def good(models, budget=0.001, extra=""):
    return f"""
        expert_stream: {{watch: true{extra}}}
        server: {{host: 127.0.0.1, port: 8000}}
        models:
          - model_path: {models['moe']}
            served_model_name: big
            expert_stream: {{budget_gib: {budget}, policy: lru}}
          - model_path: {models['dense']}
            served_model_name: small
        """


def test_host_sees_its_own_file_without_our_blocks(tmp_path, models, openai_schema):
    config = load_host_config(write(tmp_path, good(models)), openai_schema)
    doc = yaml.safe_load(config.host_yaml())
    assert "expert_stream" not in doc and doc["server"] == {"host": "127.0.0.1", "port": 8000}
    big, small = doc["models"]
    assert "expert_stream" not in big
    assert big["model_id"] == "big"  # served_model_name became model_id for 1.6.x
    assert big["queue_timeout"] == 3600 and big["max_concurrency"] == 1
    assert small == {"model_path": str(models["dense"]), "model_id": "small"}  # untouched
    assert config.streamed_settings()["big"]["budget_gib"] == 0.001
    assert [e.streamed for e in config.entries] == [True, False]


@pytest.mark.parametrize("block, message", [
    ("{budget_gib: 0.001, budjet: 3}", r"models\[0\] \(big\)\.expert_stream: unknown setting\(s\) budjet"),
    ("{budget_gib: fast}", r"models\[0\] \(big\)\.expert_stream: budget_gib must be float"),
    ("[1, 2]", r"models\[0\] \(big\)\.expert_stream: must be a mapping"),
    ("{budget_gib: 0.0000001}", r"models\[0\] \(big\)\.expert_stream\.budget_gib: .* the smallest budget is"),
    # A removed setting says so and why, rather than being ignored or called unknown.
    ("{budget_gib: 0.001, speculate: false}",
     r"models\[0\] \(big\)\.expert_stream: setting 'speculate' no longer exists: speculative decode was removed"),
])
def test_bad_settings_name_file_entry_and_key(tmp_path, models, openai_schema, block, message):
    path = write(tmp_path, f"""
        models:
          - model_path: {models['moe']}
            served_model_name: big
            expert_stream: {block}
        """)
    with pytest.raises(ConfigError, match=message) as info:
        load_host_config(path, openai_schema)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("expert_stream: {wach: true}\nmodels: [{model_path: /x}]", r"expert_stream: unknown key\(s\) wach"),
    ("expert_stream: {watch: yes-please}\nmodels: [{model_path: /x}]", r"expert_stream\.watch: must be bool"),
    ("models: []", "must be a non-empty list"),
    ("models: [{model_path: /x, model_typo: lm}]", r"models\[0\] \(/x\): unknown key\(s\) model_typo"),
    ("models: [{model_path: /x, served_model_name: a}, {model_path: /y, served_model_name: a}]",
     r"models\[1\] and models\[0\] are both served as 'a'"),
    ("models: [{model_path: /nowhere, expert_stream: {budget_gib: 1}}]",
     r"models\[0\] \(/nowhere\): model_path /nowhere is not a folder"),
    ("models: [{model_path: /x, model_type: embeddings, expert_stream: {budget_gib: 1}}]",
     "model_type 'embeddings' cannot be streamed"),
    ("models: [1, 2", "not valid YAML"),
    ("expert_stream: {defaults: {speculate_check_every: 4}}\nmodels: [{model_path: /x}]",
     r"expert_stream\.defaults: setting 'speculate_check_every' no longer exists: it tuned speculative decode"),
])
def test_bad_files_are_refused_with_where(tmp_path, openai_schema, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        load_host_config(path, openai_schema)


def test_dense_checkpoint_with_a_block_is_not_moe(tmp_path, models, openai_schema):
    path = write(tmp_path, f"models: [{{model_path: {models['dense']}, expert_stream: {{budget_gib: 1}}}}]")
    with pytest.raises(ConfigError, match="is not an MoE checkpoint"):
        load_host_config(path, openai_schema)


def test_memory_admission_refuses_the_model_that_does_not_fit(tmp_path, models, openai_schema):
    fits = load_host_config(write(tmp_path, good(models)), openai_schema, memory_bytes=8 * GIB)
    need = sum(e.resident_bytes for e in fits.entries)
    assert need > 0
    # Room for the first model and its headroom, not for the second.
    limit_gib = (fits.entries[0].resident_bytes + 0.01 * GIB + 1) / GIB + 0.001
    text = good(models, extra=f", headroom_gib: 0.01, memory_gib: {limit_gib}")
    with pytest.raises(ConfigError, match=r"models\[1\] \(small\) does not fit in memory"):
        load_host_config(write(tmp_path, text), openai_schema)


def test_defaults_apply_and_disabled_means_stock(tmp_path, models):
    path = write(tmp_path, f"""
        expert_stream: {{defaults: {{budget_gib: 0.001, policy: lru}}}}
        models:
          - {{model_path: {models['moe']}, served_model_name: a, expert_stream: true}}
          - {{model_path: {models['moe']}, served_model_name: b, expert_stream: {{budget_gib: 0.002}}}}
        """)
    config = load_host_config(path, MLX_LM_SERVER.schema(), check_models=False)
    assert [e.settings.budget_gib for e in config.entries] == [0.001, 0.002]
    assert config.entries[1].settings.policy == "lru"
    path.write_text(path.read_text().replace("expert_stream: {defaults", "expert_stream: {enabled: false, defaults"))
    assert not any(e.streamed for e in load_host_config(path, MLX_LM_SERVER.schema(), check_models=False).entries)


def test_mlx_lm_schema_refuses_host_keys_it_does_not_have(tmp_path):
    path = write(tmp_path, "models: [{model_path: /x, queue_timeout: 5}]")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) queue_timeout for mlx_lm.server"):
        MLX_LM_SERVER.load_config(path, check_models=False)


@pytest.mark.parametrize("option", ["drain_timeout_s: 5", "queue_timeout: 5"])
def test_mlx_lm_refuses_options_it_would_ignore(tmp_path, option):
    """mlx_lm.server has no request queue and no drain: the soak's invalid edits found these
    accepted and silently ignored there."""
    path = write(tmp_path, f"expert_stream: {{{option}}}\nmodels: [{{model_path: /x}}]")
    key = option.split(":")[0]
    with pytest.raises(ConfigError, match=rf"expert_stream: {key} does nothing under mlx_lm.server"):
        MLX_LM_SERVER.load_config(path, check_models=False)


def test_mlx_lm_refuses_a_default_model_nobody_serves(tmp_path):
    """Checked in load_config, so a reload refuses it too (it was checked at start only)."""
    path = write(tmp_path, "default_model: nobody\nmodels: [{model_path: /x, served_model_name: a}]")
    with pytest.raises(ConfigError, match="default_model 'nobody' is not the served_model_name of any entry"):
        MLX_LM_SERVER.load_config(path, check_models=False)


def test_file_watcher_debounces_and_ignores_nothing(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("a: 1")
    watcher = FileWatcher(path, debounce=0.5)
    assert not watcher.poll(now=0.0)
    path.write_text("a: 22")
    assert not watcher.poll(now=1.0)  # changed: wait for it to settle
    assert not watcher.poll(now=1.2)
    assert watcher.poll(now=1.6)  # stable for the debounce
    assert not watcher.poll(now=5.0)  # reported once


def test_sample_configs_parse(openai_schema):
    from pathlib import Path

    samples = Path(__file__).resolve().parents[2] / "sample_configs"
    config = load_host_config(samples / "mlx-openai-server.yaml", openai_schema, check_models=False)
    assert [e.streamed for e in config.entries] == [True, False]
    config = load_host_config(samples / "mlx_lm_server.yaml", MLX_LM_SERVER.schema(), check_models=False)
    assert [e.settings.budget_gib for e in config.entries] == ["auto", 12]
