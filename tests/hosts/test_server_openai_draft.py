"""mlx-openai-server's `draft_model_path` (speculative decoding, `lm` entries) beside a streamed
main model: the draft loads whole and stock in the entry's process, the main model streams, and
the answer is stock mlx-lm's with the same draft."""

from __future__ import annotations

import json
import shutil

import pytest

from plugin_fixtures import (
    ENGINE_SETTINGS, HostProcess, chat_text, expert_stream_argv, free_port, http_json, make_moe,
    needs_openai_server, wait_for,
)

pytestmark = pytest.mark.server
needs_openai_server()

PROMPT = "Tell me about solid state drives."
SETTINGS = ", ".join(f"{k}: {json.dumps(v)}" for k, v in ENGINE_SETTINGS.items())
DRAFTED = 3


def stock_speculative_text(moe, draft, max_tokens: int) -> str:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(moe))
    draft_model, _ = mlx_lm.load(str(draft))
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                         add_generation_prompt=True))
    return mlx_lm.generate(model, tokenizer, ids, max_tokens=max_tokens, draft_model=draft_model,
                           num_draft_tokens=DRAFTED)


def test_entry_with_a_draft_model_answers_like_stock(tmp_path):
    moe = make_moe(tmp_path)
    twin = tmp_path / "twin-draft"  # the same weights in another folder: loaded stock, drafts accepted
    shutil.copytree(moe, twin)
    port = free_port()
    path = tmp_path / "host.yaml"
    path.write_text(f"server: {{host: 127.0.0.1, port: {port}, log_level: WARNING}}\nmodels:\n"
                    f"  - model_path: {moe}\n    served_model_name: moe\n    draft_model_path: {twin}\n"
                    f"    num_draft_tokens: {DRAFTED}\n    expert_stream: {{budget_gib: 0.00005, {SETTINGS}}}\n")
    host = HostProcess(expert_stream_argv("serve", "--config", str(path), "--no-log-file"),
                       f"http://127.0.0.1:{port}", tmp_path / "server.log", tmp_path)
    try:
        host.wait_ready()
        assert chat_text(host.base, "moe", PROMPT, 16) == stock_speculative_text(moe, twin, 16)

        def stats():
            model = http_json(host.base + "/expert-stream/status")[1]["models"]["moe"]
            return model.get("stats") or {}

        # Per-layer figures come from the model process between two requests.
        done = wait_for(lambda: stats().get("totals", {}).get("misses"), timeout=120, what="the model's stats")
        assert done > 0
        assert stats()["decode"]["tokens"] == 15  # counted per yielded token, from the first one out
    finally:
        host.stop()
