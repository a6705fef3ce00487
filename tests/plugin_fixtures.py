"""Helpers for the plugin and server tests: tiny checkpoints, free ports, host processes.

Kept out of conftest.py (the lead's); conftest can `from plugin_fixtures import *` later."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from expert_stream.streaming.lab.soak.host_process import stop_process_group

REPO = Path(__file__).resolve().parents[1]
# Engine settings every test config adds to its streamed entries.
# The engine's "default" policy and lookahead from a non-loading thread were not working when these
# tests were written (KeyError 'default'; "There is no Stream(cpu, 0) in current thread" when
# mlx-openai-server generates on its worker thread); one place to drop these once they do.
ENGINE_SETTINGS: dict = {}  # streamed entries run the engine defaults
# A child model process of mlx-openai-server takes 10-60 s to import the host and load on 2 cores.
START_TIMEOUT_S = 300
MOE = dict(arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_hidden=64, bits=4,
           dtype="float32", seed=0)


def make_moe(root: Path, name: str = "moe", **overrides) -> Path:
    from expert_stream.streaming.lab.synthetic import make_checkpoint

    return make_checkpoint(Path(root) / name, progress=False, **{**MOE, **overrides})


def make_dense(root: Path, name: str = "dense", seed: int = 0) -> Path:
    """A tiny qwen3 (dense) checkpoint (the lab's generator): what `models: - model_path:
    small-dense` is in the design's example."""
    from expert_stream.streaming.lab.synthetic.dense import make_dense_checkpoint

    return make_dense_checkpoint(Path(root) / name, seed)


def non_loopback_address():
    """This machine's address on its first non-loopback interface, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            address = s.getsockname()[0]
        return None if address.startswith("127.") else address
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, method: str | None = None, timeout: float = 300):
    data = json.dumps(payload).encode() if payload is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"raw": body.decode(errors="replace")}


def http_status(url: str, headers: dict | None = None, method: str = "GET") -> tuple:
    """(status, lower-case response headers) of a request with the given headers."""
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}


def control_endpoint_refusals(base: str, port: int) -> None:
    """Assert what issue 14 item 7 asks of a running host's control endpoints (issue 27: the
    metrics and the status page answer under the same rules)."""
    for url in (base + "/expert-stream/status", base + "/expert-stream/metrics", base + "/expert-stream/"):
        assert http_status(url)[0] == 200, url
        assert http_status(url, {"X-Forwarded-For": "localhost"})[0] == 403, url
        assert http_status(url, {"Host": f"evil.example:{port}"})[0] == 403, url  # DNS rebinding
    status_url = base + "/expert-stream/status"
    for method, url in (("GET", status_url), ("POST", base + "/expert-stream/reload"),
                        ("OPTIONS", base + "/expert-stream/reload"), ("GET", base + "/expert-stream/metrics"),
                        ("GET", base + "/expert-stream/")):
        code, headers = http_status(url, {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
                                    method)
        assert code == 403 and "access-control-allow-origin" not in headers, (method, code, headers)


def scrape(base: str, headers: dict | None = None) -> dict:
    """GET /expert-stream/metrics parsed by prometheus_client's own parser:
    {(sample name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(base + "/expert-stream/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers["Content-Type"]
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counters_of(metrics: dict, model: str) -> dict:
    """The `_total` samples of one model (any rank): {(name, labels): value}."""
    return {k: v for k, v in metrics.items() if k[0].endswith("_total") and ("model", model) in k[1]}


def assert_monotonic(before: dict, after: dict) -> None:
    """Every counter of `before` is in `after`, and none went down."""
    fell = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) is None or after[k] < v}
    assert not fell, f"counters that fell or vanished: {fell}"


def scrapes_around_a_request(base: str, model: str, prompt: str, settle_s: float = 0.0) -> tuple[dict, dict]:
    """Scrapes around one streamed request: the first once it streams (one request in flight),
    a second once its decode tokens grew (no counter fell), the last `settle_s` after it finished
    (a model process writes its counters on a period). Returns (first, last)."""
    import threading

    started, result = threading.Event(), {}
    client = threading.Thread(target=lambda: result.setdefault(
        "out", stream_chat(base, model, prompt, 400, on_first=started.set)))
    client.start()
    assert started.wait(120)
    labels = (("model", model),)
    first = scrape(base)
    assert first[("expert_stream_requests_in_flight", labels)] == 1
    second = wait_for(lambda: (m := scrape(base))[("expert_stream_decode_tokens_total", labels)] >
                      first[("expert_stream_decode_tokens_total", labels)] and m, timeout=60, interval=0.2,
                      what="decode tokens to grow during the request")
    assert_monotonic(counters_of(first, model), counters_of(second, model))
    client.join(300)
    assert result["out"][3], "the request did not finish"
    time.sleep(settle_s)
    last = scrape(base)
    assert last[("expert_stream_requests_in_flight", labels)] == 0
    return first, last


def assert_metrics_are_status_counters(metrics: dict, counters: dict, model: str) -> None:
    """The scrape's cache and decode counters are the status endpoint's."""
    for counter, name in (("hits", "expert_hits"), ("misses", "expert_misses"), ("bytes_read", "read_bytes"),
                          ("decode_tokens", "decode_tokens")):
        assert metrics[(f"expert_stream_{name}_total", (("model", model),))] == counters[counter], counter


def chat(base: str, model: str, prompt: str = "hello", max_tokens: int = 12) -> tuple[int, dict]:
    return http_json(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.0})


def chat_text(base: str, model: str, prompt: str = "hello", max_tokens: int = 12) -> str:
    status, body = chat(base, model, prompt, max_tokens)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def stream_chat(base: str, model: str, prompt: str = "hello", max_tokens: int = 12, on_first=None):
    """(text, chunks, error chunks) of a streaming chat completion, read line by line.
    on_first() runs after the first content chunk arrives (while the request is in flight)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0, "stream": True}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    text, chunks, errors, done = "", 0, [], False
    with urllib.request.urlopen(request, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            # The host sends errors as {"error": {...}}, or, for an HTTPException raised while
            # streaming, as the exception's detail ({"message": ..., "type": ...}).
            if "error" in chunk or ("message" in chunk and "choices" not in chunk):
                errors.append(chunk)
                continue
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    text += piece
                    chunks += 1
                    if chunks == 1 and on_first is not None:
                        on_first()
    return text, chunks, errors, done


def stock_greedy(model_dir: Path, prompt: str, max_tokens: int) -> str:
    """The same chat completion computed by stock mlx-lm in this process (greedy)."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text)
    return mlx_lm.generate(model, tokenizer, ids, max_tokens=max_tokens)


class HostProcess:
    """A host started through `expert-stream` (or bare), in its own process group."""

    def __init__(self, argv: list[str], base: str, log_path: Path, cwd: Path, env: dict | None = None):
        self.base = base
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                        env=env, start_new_session=True)
        self.started = time.perf_counter()
        self.ready_seconds: float | None = None

    def wait_ready(self, path: str = "/v1/models", timeout: float = START_TIMEOUT_S) -> float:
        while time.perf_counter() - self.started < timeout:
            if self.process.poll() is not None:
                raise AssertionError(f"host exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + path, timeout=2) as r:
                    if r.status == 200:
                        self.ready_seconds = time.perf_counter() - self.started
                        return self.ready_seconds
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"host not ready after {timeout} s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        return self.process.wait(timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_process_group(self.process)
        self._log.close()


def expert_stream_argv(*args: str) -> list[str]:
    """The CLI as a fresh process (the console script's own entry, so spawned children import it)."""
    return [sys.executable, "-c", "import sys; from expert_stream.plugin.cli import main; sys.exit(main())", *args]


def wait_for(predicate, timeout: float = 120, interval: float = 0.5, what: str = "condition"):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s")


def openai_server_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("mlx-openai-server")
    except metadata.PackageNotFoundError:
        return False
    return True


def needs_openai_server():
    """Skips where mlx-openai-server is not installed; where it is, it must import (a broken
    install, e.g. a torchvision that does not load, fails the test instead of skipping it)."""
    if not openai_server_installed():
        pytest.skip("mlx-openai-server is not installed", allow_module_level=True)
    import app.server  # noqa: F401
