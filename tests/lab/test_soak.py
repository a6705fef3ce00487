"""The chaos soak (streaming/lab/soak): its invalid edits are each refused by the validation of
their host, its verdicts tell a clear error from an unclear one, and a short seeded run of each
host through `expert-stream` ends with no wrong answer, no hang, no unclear error."""

from __future__ import annotations

import pytest

from expert_stream.plugin.config import ConfigError
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from expert_stream.streaming.lab.soak.client import CLEAR, UNCLEAR, judge_error
from expert_stream.streaming.lab.soak.config_edits import invalid_edits
from expert_stream.streaming.lab.soak.host_process import ConfigKnobs, dump
from expert_stream.streaming.lab.soak.models import make_models
from plugin_fixtures import needs_openai_server, openai_server_installed


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("soak-models"))


def host_adapter(host):
    if host == "mlx_lm":
        return MLX_LM_SERVER
    needs_openai_server()
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    return MLX_OPENAI_SERVER


@pytest.mark.parametrize("host", ["mlx_lm", "openai"])
def test_every_invalid_edit_is_refused_and_the_valid_file_is_not(host, folders, tmp_path):
    adapter = host_adapter(host)
    doc = ConfigKnobs(with_c=True).document(host, folders, 8000)
    path = tmp_path / "host.yaml"
    path.write_text(dump(doc))
    adapter.load_config(path)
    accepted = []
    for name, edit in invalid_edits(host).items():
        path.write_text(edit(doc, host, tmp_path))
        try:
            adapter.load_config(path)
            accepted.append(name)
        except ConfigError as exc:
            assert "host.yaml" in str(exc), (name, str(exc))
    assert not accepted, f"{host} accepts these invalid edits: {accepted}"


def test_an_error_is_clear_when_it_names_the_model_and_shows_no_path():
    assert judge_error("model 'moe-a' is not served here; served: moe-b", "moe-a") == CLEAR
    assert judge_error("model 'moe-a': shard /tmp/x/model.safetensors changed on disk", "moe-a") == UNCLEAR
    assert judge_error("Internal Server Error", "moe-a") == UNCLEAR
    assert judge_error("moe-a", "moe-a") == UNCLEAR  # names it, says nothing about why


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("host, settings", [("mlx_lm", {}), ("openai", {}), ("mlx_lm", {"decode_path": "native"})],
                         ids=["mlx_lm", "openai", "mlx_lm-native"])
def test_a_short_soak_finds_nothing(host, settings, tmp_path):
    from expert_stream.streaming.lab.soak import SoakPlan, run_soak

    if host == "openai" and not openai_server_installed():
        pytest.skip("mlx-openai-server is not installed")
    summary = run_soak(SoakPlan(host, 45, seed=20261202, work=tmp_path, clients=2, deadline_s=300,
                                settings=settings))
    assert summary["failures"] == 0, summary["first failures"]
    assert summary["wrong"] == summary["hangs"] == summary["unclear errors"] == 0
    assert summary["exact"] >= 20 and summary["requests"] == (summary["exact"] + summary["clear errors"]
                                                             + summary["no server (killed by the soak)"])
    # moe-a streams at every budget the soak gives it (moe-b's auto budget may hold every expert)
    assert summary["decode paths"].get("moe-a") == [settings.get("decode_path", "python")], summary["decode paths"]
