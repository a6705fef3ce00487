"""Speculative decoding in mlx_lm.server (`--draft-model`, or a request's `draft_model`) with a
streamed main model: every token and its log-probability are what stock mlx-lm gives with the
same draft; a draft that names a streamed entry's folder is refused, at start and per request."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from plugin_fixtures import (
    ENGINE_SETTINGS, HostProcess, expert_stream_argv, free_port, http_json, make_moe,
)

pytestmark = pytest.mark.server

PROMPT = "Tell me about solid state drives."
SETTINGS = ", ".join(f"{k}: {json.dumps(v)}" for k, v in ENGINE_SETTINGS.items())
DRAFTED = 3  # --num-draft-tokens


def config(work, moe) -> str:
    path = work / "models.yaml"
    path.write_text(f"models:\n  - model_path: {moe}\n    served_model_name: moe\n"
                    f"    expert_stream: {{budget_gib: 0.00005, {SETTINGS}}}\n")
    return str(path)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    from expert_stream.streaming.lab.synthetic.draft import make_dense_draft

    work = tmp_path_factory.mktemp("mlx-lm-draft")
    moe = make_moe(work)
    dense = make_dense_draft(moe, work / "dense-draft")
    twin = work / "twin-draft"  # the same weights in another folder: loaded stock, its drafts accepted
    shutil.copytree(moe, twin)
    port = free_port()
    host = HostProcess(expert_stream_argv("mlx-lm-server", "--config", config(work, moe), "--", "--port", str(port),
                                          "--draft-model", str(dense), "--num-draft-tokens", str(DRAFTED)),
                       f"http://127.0.0.1:{port}", work / "server.log", work)
    try:
        host.wait_ready("/health")
        yield host, moe, dense, twin
    finally:
        host.stop()


def served(base: str, max_tokens: int, draft=None) -> tuple[int, dict]:
    body = {"model": "moe", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": True}
    if draft is not None:
        body["draft_model"] = str(draft)
    return http_json(base + "/v1/chat/completions", body)


def tokens_and_logprobs(answer: dict) -> list:
    return [(t["id"], t["logprob"]) for t in answer["choices"][0]["logprobs"]["content"]]


def stock_speculative(moe, draft, max_tokens: int) -> tuple[list, int]:
    """Stock mlx-lm with the same draft, in this process: (token, log-probability) pairs, and how
    many tokens came from the draft."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(moe))
    draft_model, _ = mlx_lm.load(str(draft))
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                         add_generation_prompt=True))
    out = list(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft_model=draft_model,
                                      num_draft_tokens=DRAFTED))
    return [(g.token, g.logprobs[g.token].item()) for g in out], sum(bool(g.from_draft) for g in out)


def test_draft_model_answers_like_stock(drafted):
    host, moe, dense, twin = drafted
    for draft in (None, twin):  # the --draft-model flag's dense draft, then a request's own
        code, answer = served(host.base, 16, draft)
        assert code == 200, answer
        expected, from_draft = stock_speculative(moe, twin if draft else dense, 16)
        assert tokens_and_logprobs(answer) == expected
        if draft is twin:
            assert from_draft >= 8  # the verify passes accepted drafts: several tokens a pass
    status = http_json(host.base + "/expert-stream/status")[1]
    stats = status["models"]["moe"]["stats"]
    assert stats["totals"]["misses"] > 0 and stats["totals"]["resident_calls"] == 0
    # Counted per yielded token (a verify pass is never a single-token call). mlx_lm.server keys
    # its model by (model, adapter, draft): the request naming another draft loaded the model
    # again, so these are the second request's 16 tokens, from the first one out.
    assert stats["decode"]["tokens"] == 15


def test_a_request_naming_the_streamed_folder_as_draft_is_refused(drafted):
    host, moe, _, _ = drafted
    code, answer = served(host.base, 4, moe)
    assert code != 200 or "error" in json.dumps(answer), answer
    assert "draft model" in json.dumps(answer) and "streamed entry" in json.dumps(answer)
    code, answer = served(host.base, 4)  # still serving
    assert code == 200, answer


def test_draft_model_flag_naming_a_streamed_folder_is_refused_at_start(tmp_path):
    moe = make_moe(tmp_path)
    done = subprocess.run(expert_stream_argv("mlx-lm-server", "--config", config(tmp_path, moe), "--",
                                             "--port", str(free_port()), "--draft-model", str(moe)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--draft-model" in done.stderr and "models[0] (moe), which streams" in done.stderr, done.stderr
