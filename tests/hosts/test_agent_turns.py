"""Agent turns through both hosts (issue 32): the second turn of a conversation (turn 1's
messages and answer, then a new user message) prefills only the tokens after the prefix the
host's prompt cache holds, with a streamed model, through the `openai` client.

The evidence is the engine's: `expert_stream_prompt_tokens_prefilled_total` counts the prompt
tokens that went through the streamed layers. With the host's cache off, turn 2 would count
about turn 1's whole prompt again. The answers equal stock mlx-lm's, run the way both hosts run
a conversation: mlx-lm's own LRUPromptCache, trimmed to the common prefix."""

from __future__ import annotations

import json
import random
import time

import pytest

from plugin_fixtures import HostProcess, expert_stream_argv, free_port, http_json, make_moe, needs_openai_server, scrape

pytestmark = pytest.mark.server

STEP = 2048  # stock's default prefill step: turn 1 is four chunks, prefilled layer-major
SETTINGS = {"budget_gib": 0.00005, "prefill_step": STEP}  # 3 of 8 slots a layer: the layers stream
MAX_TOKENS = 24
WORDS = ("disk cache expert layer token memory stream read write block page shard router model answer "
         "question garden river mountain window paper engine signal market winter summer number letter "
         "silver orange quiet rapid forest harbor lantern meadow copper violet").split()
NEW_MESSAGE = "Now say that again, in fewer words."
PREFILLED = "expert_stream_prompt_tokens_prefilled_total"


def long_message() -> str:
    rng = random.Random(32)  # the same ~8k tokens every run
    return " ".join(rng.choice(WORDS) for _ in range(3030))


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("agent-turns"))


@pytest.fixture(scope="module")
def stock(moe):
    """Stock mlx-lm through the conversation as a host runs it: turn 1 from an empty cache, its
    cache stored under prompt + answer tokens, turn 2 from the nearest cache, trimmed."""
    import mlx_lm
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    model, tokenizer = mlx_lm.load(str(moe))
    lru = LRUPromptCache()

    def turn(messages):
        ids = chat_ids(tokenizer, messages)
        cache, rest = lru.fetch_nearest_cache("moe", ids)
        cache = cache if cache is not None else make_prompt_cache(model)
        text, key = "", list(ids)
        for r in mlx_lm.stream_generate(model, tokenizer, rest, max_tokens=MAX_TOKENS, prompt_cache=cache):
            text += r.text
            key.append(r.token)
        lru.insert_cache("moe", key, cache)
        return {"ids": ids, "rest": len(rest), "text": text}

    first = [{"role": "user", "content": long_message()}]
    one = turn(first)
    second = first + [{"role": "assistant", "content": one["text"]}, {"role": "user", "content": NEW_MESSAGE}]
    return {"messages": first, "turns": [one, turn(second)]}


def write_config(work, moe, port=None) -> str:
    """The host's file: a top-level block, one streamed entry (mlx-openai-server adds `server`)."""
    lines = ["expert_stream: {}"]
    if port is not None:
        lines.append(f"server: {{host: 127.0.0.1, port: {port}, log_level: WARNING}}")
    lines += ["models:", f"  - model_path: {moe}", "    served_model_name: moe",
              f"    expert_stream: {json.dumps(SETTINGS)}"]
    path = work / "host.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def start(argv, port, work, ready_path):
    host = HostProcess(argv, f"http://127.0.0.1:{port}", work / "server.log", work,
                       env={"HOME": str(work), "EXPERT_STREAM_CACHE": str(work / "cache"),
                            "HF_HOME": str(work / "no-hf-cache")})
    try:
        host.wait_ready(ready_path)
    except BaseException:
        host.stop()
        raise
    return host


@pytest.fixture(scope="module")
def mlx_lm_host(moe, tmp_path_factory):
    work, port = tmp_path_factory.mktemp("agent-mlx-lm"), free_port()
    argv = expert_stream_argv("mlx-lm-server", "--config", write_config(work, moe), "--", "--host", "127.0.0.1",
                              "--port", str(port))
    host = start(argv, port, work, "/health")
    yield host
    host.stop()


@pytest.fixture(scope="module")
def openai_host(moe, tmp_path_factory):
    needs_openai_server()
    work, port = tmp_path_factory.mktemp("agent-openai"), free_port()
    host = start(expert_stream_argv("serve", "--config", write_config(work, moe, port), "--no-log-file"), port, work,
                 "/v1/models")
    yield host
    host.stop()


def prefilled(base: str, settle_s: float) -> int:
    """The engine's count of prompt tokens prefilled (mlx-openai-server's model process writes its
    counters every half second, hence the wait)."""
    time.sleep(settle_s)
    return int(scrape(base).get((PREFILLED, (("model", "moe"),)), 0))


def streamed_turn(base: str, messages) -> tuple[str, float]:
    """(answer, seconds to its first content chunk) through the openai client, streamed, greedy."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=900, max_retries=0)
    t0, first, text = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(model="moe", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first if first is not None else time.perf_counter() - t0
            text += piece
    assert first is not None, "no content streamed"
    return text, first


def two_turns(host, stock, name: str, settle_s: float) -> None:
    one, two = stock["turns"]
    assert 8000 <= len(one["ids"]) <= 8400 and one["rest"] == len(one["ids"])  # ~8k tokens, nothing cached
    before = prefilled(host.base, 0)
    text1, ttft1 = streamed_turn(host.base, stock["messages"])
    after1 = prefilled(host.base, settle_s)
    messages = stock["messages"] + [{"role": "assistant", "content": text1}, {"role": "user", "content": NEW_MESSAGE}]
    text2, ttft2 = streamed_turn(host.base, messages)
    after2 = prefilled(host.base, settle_s)
    turn1, turn2 = after1 - before, after2 - after1
    print(f"\n{name}: turn 1 {len(one['ids'])} prompt tokens, {turn1} prefilled, TTFT {ttft1:.2f} s; "
          f"turn 2 {len(two['ids'])} prompt tokens ({two['rest']} past the cached prefix), {turn2} prefilled, "
          f"TTFT {ttft2:.2f} s")
    assert (text1, text2) == (one["text"], two["text"])
    # A prompt's last token runs as its first decode step (and so does a final chunk of one token).
    assert len(one["ids"]) - 2 <= turn1 <= len(one["ids"]) - 1
    assert two["rest"] < len(one["ids"]) // 4  # the new tokens, plus what the template re-renders
    assert two["rest"] - 2 <= turn2 <= two["rest"] - 1, "turn 2 did not prefill from the host's prompt cache"
    status = http_json(host.base + "/expert-stream/status")[1]["models"]["moe"]
    assert status["stats"]["prompt_tokens_prefilled"] == after2  # one load served both turns


def test_mlx_lm_server_prefills_only_the_new_turn(mlx_lm_host, stock):
    two_turns(mlx_lm_host, stock, "mlx_lm.server", settle_s=0)


def test_mlx_openai_server_prefills_only_the_new_turn(openai_host, stock):
    two_turns(openai_host, stock, "mlx-openai-server", settle_s=1.5)
