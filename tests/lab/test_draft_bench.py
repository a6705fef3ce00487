"""`expert-stream bench --draft-model` and `--routing --acceptance`: speculative decoding beside
single-token decode, per generated token (figures are not asserted: relations between them are)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expert_stream.plugin.cli import main
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.draft_bench import accepted_prefix
from expert_stream.streaming.lab.synthetic.draft import make_dense_draft
from expert_stream.streaming.traces import RoutingTrace, save_trace


@pytest.fixture
def model(checkpoints):
    return checkpoints("qwen3_moe", layers=3, experts=16, top_k=4, shard_size_mb=1)


def bench(model, capsys, *flags) -> dict:
    budget = checkpoint_footprint(model).budget_gib_for_slots(6)
    assert main(["bench", str(model), "--budget-gib", str(budget), "--prompt-tokens", "20", "--gen-tokens", "10",
                 "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_draft_model_beside_single_token_decode(model, tmp_path, capsys):
    draft = make_dense_draft(model, tmp_path / "dense")
    r = bench(model, capsys, "--draft-model", str(draft), "--num-draft", "1,3")
    single, one, three = r["runs"]
    assert [x["num_draft"] for x in r["runs"]] == [0, 1, 3]
    assert all(x["bitwise_equal_to_stock"] and x["same_tokens_as_single"] for x in r["runs"])
    assert single["tokens_per_forward"] == 1 and single["acceptance"] is None
    for x in (one, three):
        # Every pass checks its drafts and yields the accepted ones plus one token of its own.
        # (the last pass may be cut short at --gen-tokens)
        assert x["generated"] == 10 and x["forwards"] + x["accepted"] - 1 <= x["generated"] <= x["forwards"] + x["accepted"]
        assert 0 <= x["acceptance"] <= 1
        # A random draft is rejected: each pass reads more tokens' experts for one token.
        assert x["experts_looked_up_per_token"] > single["experts_looked_up_per_token"]


def test_replayed_routing_with_a_given_acceptance(model, tmp_path, capsys):
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.permutation(16)[:4] for _ in range(2)] for _ in range(400)]).astype(np.int16)
    trace = save_trace(tmp_path / "t.npz", RoutingTrace(ids=ids, phase=None, num_experts=16, name="t"))
    runs = {}
    for acceptance in ("1.0", "0.0"):
        r = bench(model, capsys, "--routing", str(trace), "--acceptance", acceptance, "--num-draft", "3")
        runs[acceptance] = r["runs"]
    (single, full), (_, none) = runs["1.0"], runs["0.0"]
    assert full["acceptance"] == 1.0 and full["tokens_per_forward"] == pytest.approx(10 / 3, rel=0.2)
    assert none["acceptance"] == 0.0 and none["tokens_per_forward"] == 1.0
    # Distinct experts a pass looks up, per generated token. All accepted: the pass's tokens are
    # the next positions, the rows single decode uses (fewer lookups: a pass looks an expert up
    # once for all its tokens); none accepted: each pass adds three unrelated rows' experts
    # (4 tokens of top-4 among 16: ~10.9 distinct per layer against 4).
    assert full["experts_looked_up_per_token"] <= single["experts_looked_up_per_token"]
    assert none["experts_looked_up_per_token"] > 2 * single["experts_looked_up_per_token"]


def test_acceptance_is_a_prefix_of_the_drafts():
    rng = np.random.default_rng(0)
    counts = [accepted_prefix(rng, 4, 0.5) for _ in range(4000)]
    assert set(counts) == {0, 1, 2, 3, 4}
    assert np.mean(counts) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625, rel=0.08)
    assert accepted_prefix(rng, 4, 1.0) == 4 and accepted_prefix(rng, 4, 0.0) == 0


@pytest.mark.parametrize("flags, message", [
    (["--routing", "t.npz", "--draft-model", "d"], "give --acceptance"),
    (["--acceptance", "0.5"], "--acceptance is for --routing"),
    (["--draft-model", "d", "--sweep", "1,2"], "--sweep does not combine"),
    (["--draft-model", "d", "--num-draft", "0"], "--num-draft '0'"),
])
def test_flags_that_do_not_combine_are_refused(model, flags, message, capsys):
    assert main(["bench", str(model), *flags]) != 0
    assert message in capsys.readouterr().err


def test_synth_makes_drafts_with_the_main_models_tokenizer(model, tmp_path, capsys):
    from mlx_lm.utils import load

    _, tokenizer = load(str(model))
    for flags, layers in ((["--layers", "1", "--hidden", "64"], 1), (["--early-exit", "--layers", "2"], 2)):
        out = tmp_path / f"draft-{layers}"
        assert main(["synth", "--draft-for", str(model), "--out", str(out), *flags]) == 0
        draft, draft_tokenizer = load(str(out))
        assert len(draft.layers) == layers
        assert draft_tokenizer.vocab_size == tokenizer.vocab_size
        assert draft_tokenizer.encode("def f(x):") == tokenizer.encode("def f(x):")
    assert main(["synth", "--draft-for", str(model), "--out", str(tmp_path / "x"), "--early-exit"]) != 0
    assert "give --layers" in capsys.readouterr().err
