"""Paths as users write them: `~`, $VARS and cached hub ids reach the hosts and the engine as
real folders (the hosts themselves take `~/models/x` for a hub repo id and fail)."""

from __future__ import annotations

import shutil

import pytest

from expert_stream.plugin.config import ConfigError
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from plugin_fixtures import make_moe

HUB_ID = "mlx-community/Qwen3-30B-A3B-4bit"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("paths"))


def hub_snapshot(root, checkpoint, repo_id=HUB_ID, revision="0123456789abcdef0123456789abcdef01234567"):
    """Lay out `checkpoint` as the Hugging Face cache holds a downloaded repo."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def write_config(tmp_path, model_path, extra=""):
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - model_path: {model_path}\n    served_model_name: m\n"
                    f"    expert_stream: {{budget_gib: 0.001{extra}}}\n")
    return path


def test_home_and_variables_are_expanded_for_the_host(tmp_path, moe, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(moe, home / "models" / "moe")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MODELS", str(home / "models"))
    for written in ("~/models/moe", "$MODELS/moe", "${MODELS}/moe"):
        config = MLX_LM_SERVER.load_config(write_config(tmp_path, written))
        entry = config.entries[0]
        assert entry.host_entry["model_path"] == str(home / "models" / "moe") == entry.model_path
        assert entry.streamed and entry.footprint.top_k == 2


def test_warm_start_trace_path_is_expanded(tmp_path, moe, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "trace.npz").write_bytes(b"")  # only its existence is checked here
    config = MLX_LM_SERVER.load_config(write_config(tmp_path, moe, ", warm_start: ~/trace.npz"))
    assert config.entries[0].settings.warm_start == str(tmp_path / "trace.npz")


def test_cached_hub_id_resolves_to_its_snapshot_offline(tmp_path, moe, monkeypatch):
    snapshot = hub_snapshot(tmp_path / "hub", moe)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = MLX_LM_SERVER.load_config(write_config(tmp_path, HUB_ID))
    assert config.entries[0].model_path == str(snapshot) and config.entries[0].model_id == "m"


def test_hub_id_under_hf_home_loads_through_the_python_api(tmp_path, moe, monkeypatch):
    import expert_stream

    hub_snapshot(tmp_path / "hf" / "hub", moe)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, handle = expert_stream.load(HUB_ID, budget_gib=0.001, resident=False)
    try:
        assert handle.stats()["streamed_layers"] == 2
    finally:
        handle.close()


def test_uncached_hub_id_is_refused_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a hub id in the local Hugging Face cache"):
        MLX_LM_SERVER.load_config(write_config(tmp_path, HUB_ID))
    assert not (tmp_path / "empty-hub" / ("models--" + HUB_ID.replace("/", "--")) / "snapshots").exists()
