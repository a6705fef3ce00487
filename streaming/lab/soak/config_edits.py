"""Edits of the host's config file: the invalid ones (one of each kind the validation refuses),
as functions of the valid document and the host."""

from __future__ import annotations

import copy

from .host_process import dump

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg"))


def _doc_edit(change):
    def edit(doc: dict, host: str, work) -> str:
        doc = copy.deepcopy(doc)
        change(doc, work)
        return dump(doc)
    return edit


def _set(path: tuple, value):
    def change(doc, work):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return _doc_edit(change)


def _text(text):
    return lambda doc, host, work: text


def _appended(suffix):
    return lambda doc, host, work: dump(doc) + suffix


def _folder_missing(doc, work):
    doc["models"][0]["model_path"] = str(work / "no-such-folder")


def _drop_path(doc, work):
    del doc["models"][0]["model_path"]


INVALID = {
    "not YAML": _text("models: [\n  - {model_path: "),
    "not a mapping": _text("- a\n- list\n"),
    "no models": _set(("models",), []),
    "entry not a mapping": _set(("models", 0), 5),
    "entry without model_path": _doc_edit(_drop_path),
    "folder missing": _doc_edit(_folder_missing),
    "duplicate served name": _set(("models", 1, "served_model_name"), "moe-a"),
    "unknown option": _set(("expert_stream", "bogus_option"), 1),
    "option of a wrong type": _set(("expert_stream", "watch"), "yes please"),
    "poll_seconds 0": _set(("expert_stream", "poll_seconds"), 0),
    "poll_seconds inf": _set(("expert_stream", "poll_seconds"), float("inf")),
    "debounce_seconds nan": _set(("expert_stream", "debounce_seconds"), float("nan")),
    "headroom_gib 1e300": _set(("expert_stream", "headroom_gib"), 1e300),
    "memory_gib too small": _set(("expert_stream", "memory_gib"), 0.001),
    "unknown setting": _set(("models", 0, "expert_stream", "bogus_setting"), 1),
    "budget_gib negative": _set(("models", 0, "expert_stream", "budget_gib"), -1),
    "budget_gib a word": _set(("models", 0, "expert_stream", "budget_gib"), "lots"),
    "policy unknown": _set(("models", 0, "expert_stream", "policy"), "no-such-policy"),
    "top_k_override above the model's experts": _set(("models", 0, "expert_stream", "top_k_override"), 99),
    "removed setting": _set(("models", 0, "expert_stream", "speculate"), True),
    "settings block on a dense model": _set(("models", 2, "expert_stream"), {}),
    "settings block not a mapping": _set(("models", 0, "expert_stream"), [1, 2]),
    "unknown entry key": _set(("models", 0, "bogus_key"), 1),
    "nested deeper than 64": _appended("deep: " + "[" * 70 + "]" * 70 + "\n"),
    "alias expansion bomb": _appended(BOMB),
}
INVALID_MLX_LM = {
    "drain_timeout_s (mlx_lm.server has no drain)": _set(("expert_stream", "drain_timeout_s"), 5),
    "queue_timeout (mlx_lm.server has no queue)": _set(("expert_stream", "queue_timeout"), 5),
    "unknown top-level key": _set(("bogus_top_level",), 1),
    "default_model not served": _set(("default_model",), "nobody"),
}
INVALID_OPENAI = {
    "host key of a wrong type": _set(("models", 2, "max_concurrency"), "many"),
    "streamed entry of another model_type": _set(("models", 0, "model_type"), "embeddings"),
}


def invalid_edits(host: str) -> dict:
    return {**INVALID, **(INVALID_MLX_LM if host == "mlx_lm" else INVALID_OPENAI)}
