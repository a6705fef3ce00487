"""mlx_lm.server through `expert-stream mlx-lm-server`: a streamed model answers, then reloads.
The server listens on every address (0.0.0.0) so that the metrics can be read from this
machine's other address, which `metrics_allow` names (issue 27)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from plugin_fixtures import (
    ENGINE_SETTINGS, HostProcess, assert_metrics_are_status_counters, assert_monotonic, chat, chat_text, control_endpoint_refusals, counters_of,
    expert_stream_argv, free_port, http_json, http_status, make_dense, make_moe, non_loopback_address, scrape, stock_greedy,
    scrapes_around_a_request, stream_chat, wait_for,
)

pytestmark = pytest.mark.server

PROMPT = "Tell me about solid state drives."
SETTINGS = ", ".join(f"{k}: {json.dumps(v)}" for k, v in ENGINE_SETTINGS.items())


OTHER = non_loopback_address()  # this machine's address that is not loopback, or None


def models_yaml(moe, entries, metrics_allow=(OTHER,) if OTHER else ()):
    """The checkpoint is written `~/moe`, as the README writes paths (the server's HOME is its folder)."""
    allow = f", metrics_allow: {json.dumps(list(metrics_allow))}" if metrics_allow else ""
    lines = [f"expert_stream: {{watch: true, poll_seconds: 0.3, debounce_seconds: 0.3{allow}}}", "models:"]
    for served, budget in entries:
        lines += [f"  - model_path: ~/{moe.name}", f"    served_model_name: {served}",
                  f"    expert_stream: {{budget_gib: {budget:.6f}, {SETTINGS}}}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("mlx-lm-server")
    moe = make_moe(work)
    port = free_port()
    path = work / "models.yaml"
    path.write_text(models_yaml(moe, [("moe", 0.00005)]))
    host = HostProcess(expert_stream_argv("mlx-lm-server", "--config", str(path), "--", "--host", "0.0.0.0",
                                          "--port", str(port)),
                       f"http://127.0.0.1:{port}", work / "server.log", work,
                       # no Hugging Face cache: the host's own /v1/models would list nothing
                       env={"HOME": str(moe.parent), "HF_HOME": str(work / "no-hf-cache")})
    try:
        host.wait_ready("/health")
        yield host, path, moe, port
    finally:
        host.stop()


def slots(status, model="moe"):
    return status["models"][model]["stats"]["layers"]["model.layers.0.mlp.switch_mlp"]["slots"]


def test_streamed_model_answers_like_stock(server):
    host, _, moe, _ = server
    assert chat_text(host.base, "moe", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)
    status = http_json(host.base + "/expert-stream/status")[1]
    assert status["models"]["moe"]["state"] == "loaded" and slots(status) == 3
    assert status["models"]["moe"]["stats"]["totals"]["misses"] > 0
    code, listed = http_json(host.base + "/v1/models")
    assert code == 200 and [m["id"] for m in listed["data"]] == ["moe"]


def test_metrics_while_a_request_runs(server):
    """Issue 27: a scrape parsed by prometheus_client's parser while a request streams: it runs,
    and its decode tokens grow from one scrape to the next (mlx_lm.server serves in this process)."""
    host, _, _, _ = server
    _, after = scrapes_around_a_request(host.base, "moe", PROMPT)
    status = http_json(host.base + "/expert-stream/status")[1]["models"]["moe"]
    assert_metrics_are_status_counters(after, status["counters"], "moe")
    moe = (("model", "moe"),)
    assert after[("expert_stream_slots", moe)] == 6 and after[("expert_stream_budget_bytes", moe)] == round(0.00005 * 2**30)


def test_budget_change_reloads_at_the_next_request(server):
    host, path, moe, _ = server
    before = counters_of(scrape(host.base), "moe")
    path.write_text(models_yaml(moe, [("moe", 0.0001)]))
    status = wait_for(lambda: (s := http_json(host.base + "/expert-stream/status")[1])["reloads"] >= 1 and s,
                      timeout=60, what="the watcher to apply the edit")
    assert status["last_reload"]["changed"] == ["moe"]
    assert status["models"]["moe"]["state"] == "pending reload"
    assert chat_text(host.base, "moe", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)
    status = http_json(host.base + "/expert-stream/status")[1]
    assert status["models"]["moe"]["state"] == "loaded" and slots(status) == 6
    # The new model's counters add to the old one's (issue 27): none fell, the new reads count.
    after = counters_of(scrape(host.base), "moe")
    assert_monotonic(before, after)
    read = ("expert_stream_read_bytes_total", (("model", "moe"),))
    assert after[read] > before[read]
    assert status["models"]["moe"]["stats"]["totals"]["bytes_read"] < after[read]  # the handle's own: since its load


def test_alias_added_then_removed(server):
    host, path, moe, _ = server
    path.write_text(models_yaml(moe, [("moe", 0.0001), ("other", 0.00005)]).replace(
        f"  - model_path: ~/{moe.name}\n    served_model_name: other", f"  - model_path: {moe}/.\n    served_model_name: other"))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    # one folder, two entries: mlx_lm.server keys models by folder, so the file is refused
    assert code == 422 and "streams the same folder" in body["error"]
    path.write_text(models_yaml(moe, [("renamed", 0.0001)]))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    assert code == 200 and body["last_reload"]["removed"] == ["moe"] and body["last_reload"]["added"] == ["renamed"]
    assert chat_text(host.base, "renamed", PROMPT, 8) == stock_greedy(moe, PROMPT, 8)
    assert chat(host.base, "moe", PROMPT, 4)[0] != 200
    assert [m["id"] for m in http_json(host.base + "/v1/models")[1]["data"]] == ["renamed"]

def test_control_endpoints_trust_the_socket_peer_only(server):
    host, _, _, port = server
    control_endpoint_refusals(host.base, port)


def test_reload_endpoint_off_is_honoured(server):
    """reload_endpoint: false answers 403 on mlx_lm.server too (it was read by mlx-openai-server
    only); the watcher still applies edits."""
    host, path, moe, _ = server
    text = models_yaml(moe, [("renamed", 0.0001)])
    reloads = http_json(host.base + "/expert-stream/status")[1]["reloads"]
    path.write_text(text.replace("{watch: true", "{reload_endpoint: false, watch: true"))
    wait_for(lambda: http_json(host.base + "/expert-stream/status")[1]["reloads"] > reloads, timeout=60,
             what="the watcher to apply reload_endpoint: false")
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    assert code == 403 and "reload_endpoint: false" in body["error"]
    reloads = http_json(host.base + "/expert-stream/status")[1]["reloads"]
    path.write_text(text)
    wait_for(lambda: http_json(host.base + "/expert-stream/status")[1]["reloads"] > reloads, timeout=60,
             what="the watcher to turn the endpoint back on")
    assert http_json(host.base + "/expert-stream/reload", method="POST")[0] == 200


def test_unknown_model_is_a_clear_404(server):
    host, _, _, _ = server
    code, body = chat(host.base, "no-such-model", PROMPT, 4)
    assert code == 404, (code, body)
    assert "no-such-model" in json.dumps(body) and "renamed" in json.dumps(body), body


def raw_post(base: str, body: bytes) -> tuple[int, bytes]:
    import http.client
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(base).hostname, urlsplit(base).port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("body", [b"\xff\xfe\x00garbage", b'{"model": "renamed", "messages": "hello"}',
                                  b'{"model": "renamed", "max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}',
                                  b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}'])
def test_malformed_bodies_get_a_4xx_not_a_closed_connection(server, body):
    """The soak found mlx_lm.server closing the connection without a word on these (its body
    checks raise out of the handler)."""
    host, _, _, _ = server
    code, answer = raw_post(host.base, body)
    assert 400 <= code < 500 and json.loads(answer)["error"], (code, answer)


def test_an_error_while_generating_reaches_the_client_naming_the_model(server):
    """A shard truncated under a loaded streamed model: the request fails naming the model, as a
    500 or, once a stream has begun, as an error event (the soak found the connection closed);
    a load of the truncated shard (after another model was served) fails naming the model too
    (it named the shard only)."""
    host, path, moe, _ = server
    dense = make_dense(moe.parent)
    with_dense = models_yaml(moe, [("renamed", 0.00005)]) + f"  - model_path: {dense}\n    served_model_name: dense\n"
    path.write_text(with_dense)
    assert http_json(host.base + "/expert-stream/reload", method="POST")[0] == 200
    assert chat_text(host.base, "renamed", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)  # loaded, 3 slots
    shard = next(moe.glob("*.safetensors"))
    original, stat = shard.read_bytes(), shard.stat()
    try:
        with open(shard, "r+b") as f:
            f.truncate(len(original) // 2)
        code, body = chat(host.base, "renamed", "another prompt, other experts", 40)
        assert code == 500 and "'renamed'" in body["error"] and "model.safetensors" in body["error"], body
        assert "/" not in body["error"].split("model.safetensors")[0].rsplit(" ", 1)[-1]  # the name only
        text, _, errors, _ = stream_chat(host.base, "renamed", "yet another prompt", 40)
        assert errors and "'renamed'" in errors[0]["error"]["message"], (text, errors)
        assert chat(host.base, "dense", PROMPT, 4)[0] == 200  # mlx_lm.server drops "renamed" for it
        code, body = chat(host.base, "renamed", PROMPT, 8)
        assert code == 404 and body["error"].startswith("model 'renamed': ") and "truncated" in body["error"], body
    finally:
        with open(shard, "r+b") as f:
            f.write(original)
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    path.write_text(models_yaml(moe, [("renamed", 0.0001)]))  # a changed entry loads afresh
    assert http_json(host.base + "/expert-stream/reload", method="POST")[0] == 200
    assert chat_text(host.base, "renamed", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)


@pytest.mark.skipif(OTHER is None, reason="this machine has no address but loopback: no other peer to allow")
def test_metrics_allow_opens_the_metrics_to_a_named_address(server):
    """The server listens on 0.0.0.0; a request from this machine's other address is not
    loopback: metrics_allow names it, so it may read the metrics, and nothing else."""
    host, path, moe, port = server
    other = f"http://{OTHER}:{port}"
    assert ("expert_stream_model_state", (("model", "renamed"), ("state", "loaded"))) in scrape(other)
    for url in (other + "/expert-stream/status", other + "/expert-stream/"):
        assert http_status(url)[0] == 403, url
    assert http_json(other + "/expert-stream/reload", method="POST")[0] == 403
    # metrics_allow follows the file: taken out, the address is refused at once after the reload.
    path.write_text(models_yaml(moe, [("renamed", 0.0001)], metrics_allow=()))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    assert code == 200, body
    assert http_status(other + "/expert-stream/metrics")[0] == 403



def test_status_watch_draws_frames_until_ctrl_c(server):
    """`expert-stream status --watch` against the running server: frames with the model's row,
    then Ctrl-C (SIGINT) ends it cleanly."""
    host, _, _, _ = server
    watch = subprocess.Popen(expert_stream_argv("status", "--url", host.base, "--watch", "--interval", "0.3"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while sum(line.startswith("renamed ") for line in lines) < 2:  # two frames
            line = watch.stdout.readline()
            assert line, f"the watch ended early: {watch.wait()} {watch.stderr.read()}"
            lines.append(line)
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0, watch.stderr.read()
    finally:
        watch.kill()
    row = next(line for line in lines if line.startswith("renamed "))
    assert row.split()[1:4] == ["loaded", "107", "KB"] and "%" in row, row  # budget_gib 0.0001
    assert any(line.startswith("config  models.yaml") for line in lines)
    assert "Traceback" not in watch.stderr.read()


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


class _Figures(HTMLParser):
    """From the page's DOM: {(model, field): data-value}, {(model, layer): data-value}, and
    each plot's data-points."""

    def __init__(self):
        super().__init__()
        self.model, self.fields, self.layers, self.plots, self.body = None, {}, {}, {}, {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if "data-model" in a:
            self.model = a["data-model"]
        elif a.get("data-section"):
            self.model = a["data-section"]
        if "data-field" in a and "data-value" in a:
            self.fields[(self.model, a["data-field"])] = a["data-value"]
        if "data-layer" in a:
            self.layers[(self.model, a["data-layer"])] = a["data-value"]
        if "data-plot" in a:
            self.plots[a["data-plot"]] = a.get("data-points")


def _chromium(url: str, work, *args: str) -> subprocess.CompletedProcess:
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={work / 'chromium-profile'}", "--window-size=1280,1100",
             "--virtual-time-budget=6000"]
    done = subprocess.run([*flags, *args, url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium to load the status page in a real browser "
                                              "(Debian: apt-get install chromium)")
def test_status_page_in_a_real_browser(server, tmp_path):
    """Issue 27: the status page, loaded in headless Chromium against the running server after a
    few requests, draws its plot and shows the status endpoint's numbers. The screenshot stays
    in the test's folder (and in $EXPERT_STREAM_ARTIFACTS when set)."""
    host, path, moe, _ = server
    name = "renamed"
    if name not in http_json(host.base + "/expert-stream/status")[1]["models"]:  # run alone (-m slow)
        path.write_text(models_yaml(moe, [(name, 0.0001)], metrics_allow=()))
        assert http_json(host.base + "/expert-stream/reload", method="POST")[0] == 200
    chat_text(host.base, name, PROMPT, 4)  # loaded, so the history samples hold it

    def samples():  # the history's samples that hold the model
        history = http_json(host.base + "/expert-stream/status")[1]["history"]
        return sum(name in sample["models"] for sample in history["samples"])

    seen = samples()
    wait_for(lambda: samples() > seen, timeout=30, what="a sample before the requests")
    for prompt in (PROMPT, "And about hard disks?"):  # each in an interval of its own
        seen = samples()
        chat_text(host.base, name, prompt, 24)
        wait_for(lambda: samples() > seen, timeout=30, what="a history sample after the request")
    dom = _chromium(host.base + "/expert-stream/", tmp_path, "--dump-dom").stdout
    status = http_json(host.base + "/expert-stream/status")[1]  # idle: the counters hold still
    page = _Figures()
    page.feed(dom)
    assert int(page.body.get("data-polls", 0)) >= 1, dom[:2000]
    assert int(page.plots[name]) >= 2, ("the plot did not draw the requests' intervals", status["history"])
    model = status["models"][name]
    expected = {"hits": model["counters"]["hits"], "misses": model["counters"]["misses"],
                "bytes_read": model["counters"]["bytes_read"], "decode_tokens": model["counters"]["decode_tokens"],
                "slot_bytes": model["stats"]["slot_bytes"], "state": model["state"],
                "decode_path": model["stats"]["decode_path"],
                "slots": sum(layer["slots"] for layer in model["stats"]["layers"].values()),
                "budget_bytes": round(model["settings"]["budget_gib"] * 2**30)}
    shown = {field: page.fields.get((name, field)) for field in expected}
    assert shown == {k: str(v) for k, v in expected.items()}
    assert float(page.fields[(name, "hit_rate")]) == pytest.approx(
        model["counters"]["hits"] / (model["counters"]["hits"] + model["counters"]["misses"]))
    for layer, figures in model["stats"]["layers"].items():
        assert float(page.layers[(name, layer)]) == pytest.approx(
            figures["hits"] / (figures["hits"] + figures["misses"]))
    assert page.fields[("reload", "reloads")] == str(status["reloads"])
    assert page.fields[("reload", "reloads_refused")] == str(status["reloads_refused"])
    assert page.fields[("reload", "last_reload")] == status["last_reload"]["reason"]

    shot = tmp_path / "status-page.png"
    _chromium(host.base + "/expert-stream/", tmp_path, f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000
    print(f"status page screenshot: {shot}")
    if os.environ.get("EXPERT_STREAM_ARTIFACTS"):
        artifacts = Path(os.environ["EXPERT_STREAM_ARTIFACTS"])
        artifacts.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, artifacts / "status-page.png")


def test_sigint_stops_the_server_within_seconds_and_cuts_the_request_in_flight(server):
    """Last in the file: it stops the module's server."""
    host, _, _, _ = server
    started, result = threading.Event(), {}

    def stream():
        try:
            result["out"] = stream_chat(host.base, "renamed", PROMPT, 30000, on_first=started.set)
        except Exception as exc:  # the connection cut mid-stream
            result["error"] = exc

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120), "the streaming request never started"
    watch = subprocess.Popen(expert_stream_argv("status", "--url", host.base, "--watch", "--interval", "0.3"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    os.kill(host.process.pid, signal.SIGINT)
    host.wait_exit(timeout=30)
    stopped = time.perf_counter() - t0
    client.join(30)
    assert not client.is_alive(), "the request in flight hangs"
    assert stopped < 10, f"SIGINT took {stopped:.1f} s"
    assert "error" in result or not result["out"][3], result  # no [DONE]: cut, not finished
    # A `status --watch` that was following the server says so and ends (issue 27).
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 1 and "the server went away" in out, (out[-2000:], err[-2000:])
