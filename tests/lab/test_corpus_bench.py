"""`expert-stream bench --corpus`: decode teacher-forced over Python source on the trained fixture
(shared/models/tiny-code-moe), its own router deciding. Figures are not asserted (the machines
here are shared and noisy); exactness, the counts and their relations are. The corpora are this
project's own sources, which the fixture was not trained on, a different file per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import REPO, SHARED
import expert_stream
from exactness import prompt_ids
from expert_stream.plugin.cli import main
from expert_stream.streaming.footprint import checkpoint_footprint

# The shared models sit next to the repository; EXPERT_STREAM_MODELS points elsewhere (worktrees).
TINY = Path(os.environ.get("EXPERT_STREAM_MODELS", SHARED / "models")) / "tiny-code-moe"
needs_tiny = pytest.mark.skipif(not TINY.is_dir(), reason=f"the trained fixture {TINY} is not present")


def _bench(capsys, *args, slots=12, prompt=6, gen=6) -> dict:
    """The bench command's JSON (short: this CPU takes ~0.2 s per token of the fixture)."""
    budget = checkpoint_footprint(TINY).budget_gib_for_slots(slots)
    argv = ["bench", str(TINY), "--budget-gib", str(budget), "--prompt-tokens", str(prompt),
            "--gen-tokens", str(gen), "--disk-gb", "0.002", "--warmup-steps", "1", "--json", *args]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@needs_tiny
def test_teacher_forced_exact_and_lru_simulation_is_the_engine(capsys):
    """Plain LRU, no lookahead, fixed slots: the engine's cache is what the simulator replays, so
    their misses are equal; every step's logits equal stock's (the 12-token prompt takes stock's
    sorted kernel path and the prefill sweep); the counts add up."""
    corpus = REPO / "streaming" / "policy.py"
    r = _bench(capsys, "--corpus", str(corpus), "--stock", "yes", "--set", "policy=lru", "--set", "prefetch=false",
               "--set", "online_budget=false", prompt=12)
    assert r["workload"] == f"trained router, teacher-forced on {corpus}"
    assert r["exactness"] == {"checked": True, "steps_compared": 6, "steps_equal": 6, "first_differing_step": None}
    recorded = r["recorded"]
    assert recorded["decode_rows"] == r["decode_tokens"] == 5
    assert r["hits"] + r["misses"] == recorded["expert_uses"] == 5 * 12 * 6
    assert r["reads"]["hidden"] + r["reads"]["waited"] == r["misses"] > 0
    sim = recorded["sim_misses_per_token"]
    assert sim["lru"] == pytest.approx(r["misses_per_token"])
    assert sim["belady"] <= sim["lru"]
    assert r["lookahead"]["guesses"] == 0 and r["lookahead"]["by_prediction_share"] == 0.0


@needs_tiny
def test_teacher_forced_lookahead_counts_and_stays_exact(capsys):
    """With the lookahead (and the default policy, online budgets): still bitwise stock at every
    step; every expert read is hidden or waited for; predictions are counted as used."""
    r = _bench(capsys, "--corpus", str(REPO / "streaming" / "cache.py"), "--stock", "yes", "--set", "prefetch=true")
    e = r["exactness"]
    assert e["checked"] and e["steps_equal"] == e["steps_compared"] == 6
    look, reads = r["lookahead"], r["reads"]
    assert look["guesses"] > 0 and 0 <= look["guess_hits"] <= look["guesses"]
    assert 0 <= look["by_prediction"] == look["prefetch_used"] <= look["prefetch_reads"]
    # The side buffer (the default) serves guessed misses: the cache counts them as misses,
    # nothing reads them again.
    buffered = look["from_side_buffer"]
    assert 0 < buffered <= look["by_prediction"]
    demand = r["misses"] - buffered
    assert look["by_prediction_share"] == pytest.approx(look["by_prediction"] / (look["by_prediction"] + demand))
    assert reads["hidden"] + reads["waited"] == demand + look["prefetch_reads"]
    assert r["hits"] + r["misses"] == r["recorded"]["expert_uses"]
    assert set(r["recorded"]["sim_misses_per_token"]) == {"lru", "belady", "default"}


@needs_tiny
def test_every_expert_resident_runs_exact_with_no_sync(capsys):
    """A budget that holds every expert: the bench runs (it crashed on an empty recording once),
    bitwise stock, and the decode makes no host sync (recording routing adds none)."""
    experts = checkpoint_footprint(TINY).num_experts[0]
    r = _bench(capsys, "--corpus", str(REPO / "streaming" / "slots.py"), "--stock", "yes", "--set", "prefetch=false",
               slots=experts)
    e = r["exactness"]
    assert e["checked"] and e["steps_equal"] == e["steps_compared"] == 6
    assert r["misses"] == 0
    assert r["reads"]["syncs_per_token"] == 0


@needs_tiny
def test_variant_series_prints_both_and_ratios(capsys):
    r = _bench(capsys, "--corpus", str(REPO / "streaming" / "lookahead.py"), "--stock", "no",
               "--variant", "off:prefetch=false", "--variant", "on:prefetch=true", prompt=4, gen=5)
    (series,) = r["series"]
    assert series["workload"].startswith("trained router, teacher-forced on")
    assert [v["name"] for v in series["variants"]] == ["off", "on"]
    off, on = (v["summary"] for v in series["variants"])
    assert off["ratio_to_first"]["decode_tok_s"] == 1.0
    assert on["ratio_to_first"]["decode_tok_s"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
    assert on["ratio_to_first"]["bytes_per_token"] == pytest.approx(on["bytes_per_token"] / off["bytes_per_token"])
    assert off["guess_hit_rate"] is None and on["guess_hit_rate"] is not None
    assert off["exactness"] == {"checked": False, "why": "stock mlx-lm was not requested (--stock no)"}
    assert len(series["load_average"]["before"]) == 3


@pytest.fixture
def small(checkpoints):
    return checkpoints("qwen3_moe", layers=3, experts=16, top_k=4, shard_size_mb=1)


def test_a_corpus_too_short_is_refused_with_the_counts(small, tmp_path, capsys):
    short = tmp_path / "short.py"
    short.write_text("x = 1\n")
    argv = ["bench", str(small), "--budget-gib", "1", "--prompt-tokens", "64", "--gen-tokens", "8",
            "--corpus", str(short)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(short) in err and "--prompt-tokens 64 + --gen-tokens 8 need 72" in err


def test_corpus_and_routing_do_not_combine(small, tmp_path, capsys):
    argv = ["bench", str(small), "--budget-gib", "1", "--corpus", str(REPO / "streaming" / "policy.py"),
            "--routing", str(tmp_path / "t.npz")]
    assert main(argv) == 2
    assert "choose one" in capsys.readouterr().err


def test_every_expert_read_is_counted_hidden_or_waited(small):
    """The engine's counters behind the hidden share: each expert read in decode, guessed or
    missed, is counted once, as in before the layer came for it or waited for."""
    budget = checkpoint_footprint(small).budget_gib_for_slots(5)
    streamed, _, handle = expert_stream.load(small, budget_gib=budget, prefetch=True, online_budget=False)
    cache = make_prompt_cache(streamed)
    token = prompt_ids(1)
    for _ in range(16):
        logits = streamed(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    t = handle.stats()["totals"]
    # a miss served from the side buffer was read once, as a guess
    assert t["reads_landed"] + t["reads_waited"] == t["misses"] - t["guess_buffer_hits"] + t["prefetch_reads"] > 0
    handle.close()


def test_belady_from_a_full_cache_knows_what_it_holds():
    """A simulation that starts from a cache's experts (recorded_sim): Belady keeps the resident
    expert used next, even before its first access in the replayed rows."""
    from expert_stream.streaming.lab.policy_sim import BeladyPolicy, simulate_layer

    rows = np.array([[0, 1], [2, 3], [0, 1]])  # experts 0, 1 held, used again at the last row
    result = simulate_layer(rows, BeladyPolicy(8, 4, rows), 4, initial=np.array([0, 1, 5, 6]))
    assert result.accesses - result.hits == 2  # 2 and 3 evict 5 and 6, never 0 or 1


def test_capped_child_gets_the_corpus(tmp_path):
    """--memory-cap hands the config to a child process as JSON: the corpus goes with it."""
    from expert_stream.streaming.lab.bench import BenchConfig
    from expert_stream.streaming.lab.capped_bench import _config_from_json, _config_json

    cfg = BenchConfig(model_dir=tmp_path, budget_gib="auto", corpus=REPO / "streaming" / "policy.py",
                      warmup_steps=2, disk_gbps=0.5, known_t_compute=(0.1, "stock"))
    assert _config_from_json(_config_json(cfg)) == cfg
