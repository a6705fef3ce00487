"""Online per-layer budgets in the engine: slots move between layers while the model decodes,
the total never grows, and the logits stay bitwise stock's."""

from __future__ import annotations

import pytest

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming import online_budget


@pytest.mark.parametrize("prefetch", [False, True])  # True: resizes meet lookahead reads in flight
def test_slots_move_and_logits_stay_exact(checkpoints, monkeypatch, prefetch):
    monkeypatch.setattr(online_budget, "REBALANCE_EVERY", 2)
    path = checkpoints("qwen3_moe", layers=4)
    stock, streamed, handle = load_pair(path, slots=6, policy="default", prefetch=prefetch)
    budget = streamed.model.layers[0].mlp.switch_mlp.online_budget
    assert budget is not None and budget.slots() == [6] * 4
    moved = []
    for seed in range(3):
        assert_same_logits(stock, streamed, prompt_ids(12, seed=seed), decode_steps=24)
        moved.append(budget.moves)
        size = budget.size[budget.streams[0]]
        assert budget.capacity == 24 * size and budget.held() <= budget.capacity  # never more than the budget
        assert min(budget.slots()) >= 4  # a token's experts always fit
    assert moved[-1] > 0, "no slot moved: the test does not exercise resizing"
    handle.close()


def test_off_and_single_layer(checkpoints):
    """Off, or one layer: no slot moves between layers (the budget object stays, to follow a
    change of the model's budget)."""
    path = checkpoints("qwen3_moe", layers=4)
    _, streamed, handle = load_pair(path, slots=6, online_budget=False)
    assert streamed.model.layers[0].mlp.switch_mlp.online_budget.rebalancing is False
    handle.close()
    path = checkpoints("qwen3_moe", layers=1)
    _, streamed, handle = load_pair(path, slots=6)
    assert streamed.model.layers[0].mlp.switch_mlp.online_budget.rebalancing is False  # nothing to move
    handle.close()
