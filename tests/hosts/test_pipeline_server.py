"""mlx_lm.server's pipeline mode through the plugin: `mlx.launch -n 2 --backend ring ... expert-stream
mlx-lm-server --config X -- --pipeline`, two ranks on 127.0.0.1, each with its own copy of the
checkpoint (rank 1's lacks the shards of rank 0's layers only) and its own copy of the config;
the answer equals one process's stock mlx-lm, rank 0's status lists both ranks' counters, a
reload applies on both ranks or on none, and a rank missing one of its own shards makes every
request fail with the shard and the rank."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from plugin_fixtures import (
    HostProcess, assert_monotonic, chat, chat_text, counters_of, free_port, http_json, scrape, stock_greedy, wait_for,
)
from test_pipeline import LAYERS, _mlx_launch, _shards_by_layers

from expert_stream.streaming.footprint import checkpoint_footprint

pytestmark = [pytest.mark.slow, pytest.mark.server]
PROMPT = "Tell me about solid state drives."
CLI = "import sys; from expert_stream.plugin.cli import main; sys.exit(main())"


@pytest.fixture(scope="module")
def model(checkpoints):
    return checkpoints("deepseek_v3", layers=LAYERS, bits=0, shard_size_mb=1)


def _copies(root: Path, src: Path, drop) -> list[str]:
    """rank0/, rank1/ copies of the checkpoint; `drop(layers)` picks rank 1's shards to leave out."""
    for rank in (0, 1):
        shutil.copytree(src, root / f"rank{rank}")
    dropped = sorted(s for s, layers in _shards_by_layers(src).items() if drop(layers))
    for shard in dropped:
        (root / "rank1" / shard).unlink()
    return dropped


def _write_config(root: Path, budget: float, ranks=(0, 1)) -> None:
    """Each rank's own copy of the config, as on two machines: models0.yaml, models1.yaml.
    $MLX_RANK (set by mlx.launch for each rank) names each rank's file and checkpoint folder."""
    for rank in ranks:
        (root / f"models{rank}.yaml").write_text(
            "models:\n  - model_path: " + str(root) + "/rank$MLX_RANK\n    served_model_name: moe\n"
            f"    expert_stream: {{budget_gib: {budget:.6f}, policy: lru}}\n")


def _start(root: Path, budget: float, ring_port: int) -> HostProcess:
    _write_config(root, budget)
    port = free_port()
    argv = [*_mlx_launch(), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring", "--starting-port",
            str(ring_port), "--python", sys.executable, "-c", CLI, "mlx-lm-server", "--config",
            str(root / "models$MLX_RANK.yaml"), "--", "--pipeline", "--host", "127.0.0.1", "--port", str(port)]
    host = HostProcess(argv, f"http://127.0.0.1:{port}", root / "server.log", root,
                       env={"HOME": str(root), "HF_HOME": str(root / "no-hf-cache")})
    host.wait_ready("/health")
    return host


def test_pipeline_server_answers_like_stock_reports_every_rank_and_reloads_on_all(model, tmp_path, capsys):
    fp = checkpoint_footprint(model)
    dropped = _copies(tmp_path, model, lambda layers: layers and layers <= {2, 3})  # rank 0 runs 2-3
    assert dropped
    budget = fp.budget_gib_for_slots(fp.top_k)
    host = _start(tmp_path, budget, 32460)
    stock = stock_greedy(model, PROMPT, 12)
    try:
        assert chat_text(host.base, "moe", PROMPT, 12) == stock, host.log()[-3000:]
        # The ranks gather their counters between two requests: the one after the answer is imminent.
        pipeline = wait_for(lambda: (p := http_json(host.base + "/expert-stream/status")[1]["pipeline"])
                            and all(r["misses"] for r in p["per_rank"]) and p, timeout=30, what="both ranks' counters")
        assert pipeline["ranks"] == 2 and pipeline["model"] == "moe", pipeline
        by_rank = {r["rank"]: r for r in pipeline["per_rank"]}
        assert by_rank[0]["layers"] == [2, 4] and by_rank[1]["layers"] == [0, 2], by_rank
        for rank in (0, 1):
            assert by_rank[rank]["loaded"] and by_rank[rank]["streamed_layers"] > 0, by_rank
            assert by_rank[rank]["misses"] > 0 and by_rank[rank]["bytes_read"] > 0, by_rank
        from expert_stream.plugin.cli import main

        assert main(["status", "--url", host.base]) == 0
        printed = capsys.readouterr().out
        assert "pipeline: 2 ranks, moe" in printed and "rank 0: layers 2-3, 2 streamed" in printed, printed
        assert "rank 1: layers 0-1, 1 streamed" in printed, printed
        # Issue 27: the metrics carry each rank's cache figures; the model's counters sum the ranks'.
        metrics = scrape(host.base)
        for rank in (0, 1):
            labels = (("model", "moe"), ("rank", str(rank)))
            assert metrics[("expert_stream_expert_misses_total", labels)] == by_rank[rank]["counters"]["misses"] > 0
            assert metrics[("expert_stream_slot_bytes", labels)] == by_rank[rank]["slot_bytes"]
        model_counters = http_json(host.base + "/expert-stream/status")[1]["models"]["moe"]["counters"]
        assert model_counters["misses"] == sum(r["counters"]["misses"] for r in by_rank.values())
        before = counters_of(metrics, "moe")
        # A budget edit on rank 0's machine only: refused on every rank, naming the rank that differs.
        _write_config(tmp_path, 1.5 * budget, ranks=(0,))
        code, body = http_json(host.base + "/expert-stream/reload", method="POST")
        assert code == 422 and "reload refused on every rank: rank 1's copy of the file differs" in body["error"], body
        assert http_json(host.base + "/expert-stream/status")[1]["reloads"] == 0  # rank 0 did not apply it either
        # Then on both: every rank applies it at the same step, and reloads at the next request.
        _write_config(tmp_path, 1.5 * budget, ranks=(1,))
        code, body = http_json(host.base + "/expert-stream/reload", method="POST")
        assert code == 200 and body["last_reload"]["changed"] == ["moe"], body
        assert chat_text(host.base, "moe", PROMPT, 12) == stock
        rows = lambda: {r["rank"]: r for r in http_json(host.base + "/expert-stream/status")[1]["pipeline"]["per_rank"]}  # noqa: E731
        after = wait_for(lambda: (a := rows())[0]["slot_bytes"] > by_rank[0]["slot_bytes"] and a, timeout=30,
                         what="rank 0's new slots")
        # rank 0: 9 slots in each of its 2 MoE layers instead of 6; rank 1's one layer now holds all 16 experts
        assert after[1]["resident_layers"] == 1 and after[1]["streamed_layers"] == 0, (by_rank, after)
        assert_monotonic(before, counters_of(scrape(host.base), "moe"))  # across the reload, on each rank
    finally:
        host.stop()


def test_a_rank_missing_its_shard_answers_the_shard_and_the_rank(model, tmp_path):
    fp = checkpoint_footprint(model)
    dropped = _copies(tmp_path, model, lambda layers: bool(layers & {0, 1}))  # rank 1 runs 0-1
    host = _start(tmp_path, fp.budget_gib_for_slots(fp.top_k), 32480)
    try:
        code, body = chat(host.base, "moe", PROMPT, 4)
        assert code != 200
        assert f"rank 1 of the pipeline could not load its layers: {dropped[0]}: missing, but rank 1 needs it" \
            in body["error"], body
    finally:
        host.stop()
