"""The one reload planner both hosts execute (reload.plan_reload): what a new config removes,
changes, adds and leaves alone, by served id and in file order, and which changed entries may
load beside their old model. Real configs parsed from files on disk."""

from __future__ import annotations

import textwrap

from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from expert_stream.plugin.reload import ReloadRecord, plan_reload

GIB = 1 << 30


def config(tmp_path, models: str, options: str = "{}"):
    path = tmp_path / "host.yaml"
    path.write_text(textwrap.dedent(f"expert_stream: {options}\nmodels: [{models}]\n"))
    return MLX_LM_SERVER.load_config(path, check_models=False)


A1 = "{model_path: /a, served_model_name: a, expert_stream: {budget_gib: 1}}"
A2 = "{model_path: /a, served_model_name: a, expert_stream: {budget_gib: 2}}"
B = "{model_path: /b, served_model_name: b}"
C = "{model_path: /c, served_model_name: c}"
D = "{model_path: /d, served_model_name: d}"


def test_start_loads_every_entry(tmp_path):
    new = config(tmp_path, f"{A1}, {B}")
    plan = plan_reload(None, new)
    assert (plan.removed, plan.changed, plan.added, plan.unchanged) == ((), (), ("a", "b"), ())
    assert plan.unload == [] and [e.model_id for e in plan.load] == ["a", "b"]
    assert plan.applied() == [("added", "a"), ("added", "b")]


def test_an_edit_removes_changes_adds_and_keeps(tmp_path):
    old = config(tmp_path, f"{A1}, {B}, {C}")
    new = config(tmp_path, f"{D}, {C}, {A2}")
    plan = plan_reload(old, new)
    assert (plan.removed, plan.changed, plan.added, plan.unchanged) == (("b",), ("a",), ("d",), ("c",))
    # What stops serving comes from the old config (the old settings), what starts from the new.
    assert [(e.model_id, e.settings and e.settings.budget_gib) for e in plan.unload] == [("b", None), ("a", 1)]
    assert [(e.model_id, e.settings and e.settings.budget_gib) for e in plan.load] == [("a", 2), ("d", None)]
    assert plan.applied() == [("removed", "b"), ("changed", "a"), ("added", "d")]
    assert plan.summary() == {"removed": ["b"], "changed": ["a"], "added": ["d"]}


def test_only_what_the_model_depends_on_changes_an_entry(tmp_path):
    old = config(tmp_path, f"{A1}, {B}")
    moved = config(tmp_path, f"{B}, {A1}")  # reordered, nothing else
    plan = plan_reload(old, moved)
    assert plan.changed == () and plan.unchanged == ("b", "a") and plan.load == [] and plan.unload == []
    adapter = config(tmp_path, f"{A1}, {{model_path: /b, served_model_name: b, adapter_path: /ad}}")
    assert plan_reload(old, adapter).changed == ("b",)  # a host key counts as much as a setting
    off = config(tmp_path, f"{A1}, {B}", "{enabled: false}")
    assert plan_reload(old, off).changed == ("a",)  # no longer streamed


def test_a_changed_entry_loads_beside_the_old_one_only_when_both_fit(tmp_path):
    # Unknown sizes count 0: each entry needs its headroom (1 GiB), the new config 2 + the old a 1.
    old = config(tmp_path, f"{A1}, {B}", "{headroom_gib: 1, memory_gib: 3}")
    fits = config(tmp_path, f"{A2}, {B}", "{headroom_gib: 1, memory_gib: 3}")
    tight = config(tmp_path, f"{A2}, {B}", "{headroom_gib: 1, memory_gib: 2.5}")
    assert plan_reload(old, fits).beside == {"a"}
    assert plan_reload(old, tight).beside == set() and plan_reload(old, tight).changed == ("a",)


def test_the_record_counts_reloads_not_the_start(tmp_path):
    first = config(tmp_path, f"{A1}")
    record = ReloadRecord(str(first.path), "h", "1")
    record.applied(plan_reload(None, first), "start", 0.1)
    assert record.reloads == 0 and record.applied_hash == first.text_hash
    second = config(tmp_path, f"{A2}")
    record.applied(plan_reload(first, second), "endpoint", 0.2, cut_off=0)
    assert record.reloads == 1 and record.applied_hash == second.text_hash
    assert record.last_reload == {"reason": "endpoint", "removed": [], "changed": ["a"], "added": [],
                                  "seconds": 0.2, "cut_off": 0}
