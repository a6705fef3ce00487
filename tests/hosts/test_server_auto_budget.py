"""Two streamed `budget_gib: auto` models in one mlx-openai-server (real host processes on
127.0.0.1): they share the memory; an edit removes one and the other's budget grows, without a
reload of its entry, shown in status; adding it back shrinks the running one first. Every
answer equals stock's greedy answer."""

from __future__ import annotations

import pytest

from plugin_fixtures import (
    HostProcess, chat_text, expert_stream_argv, free_port, http_json, make_moe, needs_openai_server, stock_greedy,
)

pytestmark = pytest.mark.server
needs_openai_server()

GIB = 1 << 30
PROMPT = "Tell me about solid state drives."
CACHE_GIB = 0.001  # MLX cache cap of each model process: small, so that the experts are what the limit decides


def config_text(models, port, memory_bytes, names):
    lines = [f"expert_stream: {{memory_gib: {memory_bytes / GIB!r}, headroom_gib: 0, "
             f"defaults: {{mlx_cache_limit_gib: {CACHE_GIB}}}}}",
             f"server: {{host: 127.0.0.1, port: {port}, log_level: WARNING}}", "models:"]
    for name in names:
        lines.append(f"  - {{model_path: {models[name]}, served_model_name: {name}, expert_stream: {{}}}}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto-server-checkpoints")
    return {"a": make_moe(root, "a"), "b": make_moe(root, "b", seed=1)}


@pytest.fixture(scope="module")
def sizes(models, tmp_path_factory):
    """Each model's experts and what its process holds besides slots, as admission counts them."""
    from expert_stream.plugin.config import load_host_config
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    path = tmp_path_factory.mktemp("auto-sizes") / "host.yaml"
    path.write_text(config_text(models, 0, 64 * GIB, ["a", "b"]))
    config = load_host_config(path, MLX_OPENAI_SERVER.schema())
    out = {}
    for e in config.entries:
        fixed = e.footprint.trunk_bytes + e.footprint.kv.bytes_for(e.settings.context_length) + int(CACHE_GIB * GIB)
        out[e.model_id] = (e.footprint.expert_bytes, fixed)
    return out


@pytest.fixture(scope="module")
def server(models, sizes, tmp_path_factory):
    work = tmp_path_factory.mktemp("auto-server")
    port = free_port()
    # Half of all experts free beside both models: each gets about half of its own.
    memory = sizes["a"][1] + sizes["b"][1] + (sizes["a"][0] + sizes["b"][0]) // 2
    path = work / "host.yaml"
    path.write_text(config_text(models, port, memory, ["a", "b"]))
    host = HostProcess(expert_stream_argv("serve", "--config", str(path), "--no-log-file"),
                       f"http://127.0.0.1:{port}", work / "server.log", work)
    try:
        host.wait_ready()
        yield host, path, port, memory
    finally:
        host.stop()


def status(host) -> dict:
    return http_json(host.base + "/expert-stream/status")[1]


def reload(host, path, text) -> dict:
    path.write_text(text)
    code, body = http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)
    assert code == 200, body
    return body


def test_models_share_memory_and_a_removal_grows_the_other(server, models, sizes, capsys):
    from expert_stream.plugin.cli import main

    host, path, port, memory = server
    expected = {name: stock_greedy(models[name], PROMPT, 16) for name in ("a", "b")}
    for name in ("a", "b"):
        assert chat_text(host.base, name, PROMPT, 16) == expected[name]
    before = status(host)["models"]
    ea, eb = sizes["a"][0], sizes["b"][0]
    budget_a = before["a"]["budget"]
    assert budget_a["auto"] and 0 < budget_a["budget_bytes"] < ea
    assert budget_a["budget_bytes"] + before["b"]["budget"]["budget_bytes"] == (ea + eb) // 2
    assert [t["name"] for t in budget_a["terms"]] == ["trunk", "KV cache", "MLX cache", "headroom", "other models"]
    assert before["a"]["stats"]["budget"]["budget_bytes"] == budget_a["budget_bytes"]  # the model process's own view
    assert before["a"]["stats"]["slot_bytes"] <= budget_a["budget_bytes"]

    body = reload(host, path, config_text(models, port, memory, ["a"]))
    assert body["last_reload"]["removed"] == ["b"] and body["last_reload"]["changed"] == []
    after = status(host)["models"]
    assert set(after) == {"a"} and after["a"]["loaded_at"] == before["a"]["loaded_at"]  # not reloaded
    assert after["a"]["budget"]["budget_bytes"] == ea  # every expert: room enough now
    assert after["a"]["stats"]["slot_bytes"] == ea  # its layers grew between two of its requests
    assert chat_text(host.base, "a", PROMPT, 16) == expected["a"]
    assert main(["status", "--url", host.base]) == 0
    assert f"a: ready, streamed, budget {round(ea / GIB, 4)} GiB (auto)" in capsys.readouterr().out

    body = reload(host, path, config_text(models, port, memory, ["a", "b"]))
    assert body["last_reload"]["added"] == ["b"] and body["last_reload"]["changed"] == []
    again = status(host)["models"]
    assert again["a"]["loaded_at"] == before["a"]["loaded_at"]
    assert again["a"]["budget"]["budget_bytes"] == budget_a["budget_bytes"]  # shrunk back, before b loaded
    assert again["a"]["stats"]["slot_bytes"] <= budget_a["budget_bytes"]
    for name in ("a", "b"):
        assert chat_text(host.base, name, PROMPT, 16) == expected[name]
    assert "budget" in http_json(host.base + "/expert-stream/status")[1]["models"]["b"]
