"""Memory admission of a host config with `budget_gib: auto`: auto entries get the limit minus
every other term, split between them in proportion to their expert bytes (mlx-openai-server
holds them all) or each sized alone (mlx_lm.server holds one at a time); a number still wins;
an entry whose smallest budget does not fit is refused by name with every term; an auto entry's
fingerprint does not change when its number is resolved differently."""

from __future__ import annotations

import textwrap

import pytest

from expert_stream.plugin.config import ConfigError, load_host_config
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from expert_stream.plugin.reload import plan_reload
from plugin_fixtures import make_moe, needs_openai_server

GIB = 1 << 30
MB = 1 << 20
CACHE_GIB = 0.001  # each entry's MLX cache cap: small, so that the experts are what the limit decides


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto-checkpoints")
    return {"a": make_moe(root, "a"), "b": make_moe(root, "b", layers=4, seed=1)}


@pytest.fixture(scope="module")
def openai_schema():
    needs_openai_server()
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    return MLX_OPENAI_SERVER.schema()


def config_text(models, memory_bytes, b_budget="auto", context=256, host_context=True):
    """`host_context`: the entries' own context_length (mlx-openai-server's key), else the
    expert_stream setting (mlx_lm.server has no such key)."""
    own = f"context_length: {context}, " if host_context else ""
    ours = "" if host_context else f"context_length: {context}, "
    return textwrap.dedent(f"""
        expert_stream: {{memory_gib: {memory_bytes / GIB!r}, headroom_gib: 0,
                         defaults: {{mlx_cache_limit_gib: {CACHE_GIB}}}}}
        models:
          - {{model_path: {models['a']}, served_model_name: a, {own}expert_stream: {{{ours}}}}}
          - {{model_path: {models['b']}, served_model_name: b, {own}
              expert_stream: {{{ours}budget_gib: {b_budget}}}}}
        """)


def load(tmp_path, schema, text):
    path = tmp_path / "host.yaml"
    path.write_text(text)
    return load_host_config(path, schema)


def fixed_terms(entry, context=256) -> int:
    fp = entry.footprint
    return fp.trunk_bytes + fp.kv.bytes_for(context) + int(CACHE_GIB * GIB)


def sizes(tmp_path, schema, models, host_context=True):
    """Each entry's experts, smallest budget and what it holds besides its slots."""
    config = load(tmp_path, schema, config_text(models, 64 * GIB, host_context=host_context))
    return {e.model_id: (e.footprint.expert_bytes, e.footprint.min_budget_bytes, fixed_terms(e))
            for e in config.entries}


def test_two_auto_entries_share_the_free_memory(tmp_path, models, openai_schema):
    size = sizes(tmp_path, openai_schema, models)
    (ea, sa, fa), (eb, sb, fb) = size["a"], size["b"]
    free = (ea + eb) // 2  # half of all experts
    config = load(tmp_path, openai_schema, config_text(models, fa + fb + free))
    a, b = config.entries
    assert a.budget.bytes + b.budget.bytes == free  # all of it, none left over
    # Each gets its smallest budget, then the same share of what it could still use.
    assert abs((a.budget.bytes - sa) / (ea - sa) - (b.budget.bytes - sb) / (eb - sb)) < 1e-6
    assert a.budget.shared and b.budget.shared  # later models take memory from them: they stay resizable
    why = a.budget_status()
    assert why["auto"] and why["budget_gib"] == round(a.budget.bytes / GIB, 4)
    assert why["limit_source"] == "expert_stream.memory_gib"
    terms = {t["name"]: t for t in why["terms"]}
    assert list(terms) == ["trunk", "KV cache", "MLX cache", "headroom", "other models"]
    assert terms["KV cache"]["note"] == "256 tokens, measured from the model's caches"  # the host's context_length
    assert terms["other models"]["note"] == "b"
    # Plenty of memory: each gets every expert, and no more.
    config = load(tmp_path, openai_schema, config_text(models, 64 * GIB))
    assert [e.budget.bytes for e in config.entries] == [ea, eb]


def test_a_number_wins_and_auto_takes_the_rest(tmp_path, models, openai_schema):
    size = sizes(tmp_path, openai_schema, models)
    (ea, _, fa), (eb, _, fb) = size["a"], size["b"]
    number = eb // 2
    number_gib = number / GIB
    config = load(tmp_path, openai_schema, config_text(models, fa + fb + number + ea // 3, b_budget=repr(number_gib)))
    a, b = config.entries
    assert b.budget is None and b.settings.budget_gib == number_gib
    assert b.budget_status() == {"budget_gib": number_gib, "budget_bytes": number, "auto": False}
    assert a.budget.bytes == ea // 3


def test_one_model_at_a_time_sizes_each_alone(tmp_path, models):
    size = sizes(tmp_path, MLX_LM_SERVER.schema(), models, host_context=False)
    (ea, _, fa), (eb, _, fb) = size["a"], size["b"]
    limit = fb + eb // 2  # b gets half its experts; a, alone too, gets what is left beside its own terms
    config = load(tmp_path, MLX_LM_SERVER.schema(), config_text(models, limit, host_context=False))
    a, b = config.entries
    assert b.budget.bytes == eb // 2 and a.budget.bytes == min(limit - fa, ea)
    assert not a.budget.shared
    assert "other models" not in {t["name"] for t in a.budget_status()["terms"]}


def test_the_smallest_budget_that_does_not_fit_is_refused_by_name(tmp_path, models, openai_schema):
    size = sizes(tmp_path, openai_schema, models)
    (_, sa, fa), (_, sb, fb) = size["a"], size["b"]
    with pytest.raises(ConfigError) as err:
        load(tmp_path, openai_schema, config_text(models, fa + fb + sa + sb // 2))
    message = str(err.value)
    assert "models[1] (b) does not fit in memory" in message
    assert "(expert_stream.memory_gib)" in message and "the smallest budget" in message
    for term in ("trunk", "KV cache", "MLX cache", "headroom"):
        assert term in message
    assert "the models before it take" in message and "remove a model" in message
    with pytest.raises(ConfigError, match=r"models\[0\] \(a\) does not fit in memory"):
        load(tmp_path, MLX_LM_SERVER.schema(), config_text(models, fa + sa // 2, host_context=False))


def test_an_auto_entry_keeps_its_fingerprint_when_its_number_changes(tmp_path, models, openai_schema):
    size = sizes(tmp_path, openai_schema, models)
    (ea, _, fa), (eb, _, fb) = size["a"], size["b"]
    before = load(tmp_path, openai_schema, config_text(models, fa + fb + (ea + eb) // 3))
    after = load(tmp_path, openai_schema, config_text(models, fa + fb + (ea + eb) // 2))
    assert after.entries[0].budget.bytes > before.entries[0].budget.bytes
    plan = plan_reload(before, after)
    assert plan.changed == () and plan.unchanged == ("a", "b")  # nothing reloads; the budgets follow


def test_context_length_is_the_hosts_own_where_it_has_one(tmp_path, models, openai_schema):
    text = config_text(models, 64 * GIB).replace("expert_stream: {}", "expert_stream: {context_length: 100}")
    assert "context_length: 100" in text
    with pytest.raises(ConfigError, match=r"models\[0\] \(a\)\.expert_stream\.context_length: mlx-openai-server has "
                                          r"its own `context_length`"):
        load(tmp_path, openai_schema, text)
    config = load(tmp_path, MLX_LM_SERVER.schema(), textwrap.dedent(f"""
        models:
          - {{model_path: {models['a']}, served_model_name: a, expert_stream: {{context_length: 100}}}}
          - {{model_path: {models['b']}, served_model_name: b, expert_stream: {{}}}}
        """))
    a, b = config.entries
    assert a.settings.context_length == 100 and b.settings.context_length == 32768  # the documented default
    kv = {e.model_id: {t["name"]: t for t in e.budget_status()["terms"]}["KV cache"]["note"] for e in config.entries}
    assert kv == {"a": "100 tokens, measured from the model's caches", "b": "32768 tokens, measured from the model's caches"}


def test_a_draft_model_counts_beside_its_entry_and_may_not_be_a_streamed_folder(tmp_path, models, openai_schema):
    """mlx-openai-server loads an entry's draft_model_path whole in the entry's process: its bytes
    are a term of the entry's auto budget; a streamed entry's folder is refused as a draft."""
    from expert_stream.streaming.checkpoint import CheckpointIndex
    from expert_stream.streaming.lab.synthetic.draft import make_dense_draft

    draft = make_dense_draft(models["a"], tmp_path / "draft")
    text = config_text(models, 64 * GIB).replace("served_model_name: a,", f"served_model_name: a, draft_model_path: {draft},")
    a, b = load(tmp_path, openai_schema, text).entries
    terms = {t["name"]: t for t in a.budget_status()["terms"]}
    assert terms["draft model"]["gib"] == round(CheckpointIndex(draft).total_bytes() / GIB, 4) > 0
    assert terms["draft model"]["note"] == "draft_model_path, loaded whole"
    assert "draft model" not in {t["name"] for t in b.budget_status()["terms"]}
    refused = config_text(models, 64 * GIB).replace("served_model_name: a,",
                                                    f"served_model_name: a, draft_model_path: {models['b']},")
    with pytest.raises(ConfigError, match=r"models\[0\] \(a\)\.draft_model_path is the folder of models\[1\] \(b\), "
                                          "which streams"):
        load(tmp_path, openai_schema, refused)
