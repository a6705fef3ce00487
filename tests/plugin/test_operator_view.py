"""Issue 27, the parts that need no server: the counters' ledger and history, the metrics of a
status document built from a real streamed model (parsed by prometheus_client's own parser),
who may read the metrics (metrics_allow), and the status page being one self-contained file."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from expert_stream.plugin.config import ConfigError, parse_options
from expert_stream.plugin.endpoint_guard import allow_list, refusal
from expert_stream.plugin.live_figures import COUNTERS, CounterLedger, handle_counters
from expert_stream.plugin.metrics import COUNTER_METRICS, exposition
from expert_stream.plugin.reload import ModelState, ReloadRecord
from expert_stream.plugin.status_history import StatusHistory, add_figures

ROOT = Path(__file__).resolve().parents[2]


def values(**kw):
    return [float(kw.get(c, 0)) for c in COUNTERS]


def test_ledger_keeps_counters_monotonic_across_sources():
    ledger = CounterLedger()
    ledger.observe("m", 1, values(hits=10, decode_seconds=1.5))
    ledger.observe("m", 1, values(hits=12, decode_seconds=2.0))
    assert ledger.totals("m")["hits"] == 12 and ledger.totals("m")["decode_seconds"] == 2.0
    # Make before break: a second process serves beside the first; both count.
    ledger.observe("m", 2, values(hits=3))
    assert ledger.totals("m")["hits"] == 15
    ledger.retire("m", 1)  # the first one's process ended: its last figures stay
    ledger.observe("m", 2, values(hits=5))
    assert ledger.totals("m")["hits"] == 17 and ledger.sources("m") == [2]
    # The same source counting from zero again (a process restarted under the same row).
    ledger.observe("m", 2, values(hits=1))
    assert ledger.totals("m")["hits"] == 18
    assert ledger.totals("other")["hits"] == 0


def test_history_is_bounded_and_its_rates_say_what_happened():
    history = StatusHistory(length=4, interval_s=5)
    for i in range(10):
        history.add({"m": {"hits": 10 * i, "misses": 10 * i, "bytes_read": 1000 * i, "decode_tokens": 2 * i,
                           "decode_seconds": 0.5 * i, "decode_bytes": 600 * i}}, at=100.0 + 5 * i)
    samples = history.as_dict()["samples"]
    assert len(samples) == 4 and samples[0]["t"] == 130.0
    rates = history.rates("m")
    assert rates == {"window_s": 15.0, "tokens_per_second": 4.0, "hit_rate": 0.5, "read_bytes_per_second": 200.0,
                     "bytes_per_token": 300.0}
    history.add({"m": {"hits": 90, "misses": 90, "bytes_read": 9000, "decode_tokens": 18, "decode_seconds": 4.5,
                       "decode_bytes": 5400}}, at=200.0)
    idle = history.rates("m", window_s=10)  # nothing happened in the last 10 s
    assert idle["tokens_per_second"] is None and idle["hit_rate"] is None and idle["bytes_per_token"] is None
    assert history.rates("absent")["hit_rate"] is None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real streamed model that decoded a few tokens, and its handle."""
    import mlx_lm

    import expert_stream
    from plugin_fixtures import make_moe

    path = make_moe(tmp_path_factory.mktemp("operator"))
    model, tokenizer, handle = expert_stream.load(str(path), budget_gib=0.00005)
    mlx_lm.generate(model, tokenizer, "Tell me about solid state drives.", max_tokens=12)
    return model, handle


def status_document(handle, pipeline=None) -> dict:
    record = ReloadRecord("/somewhere/host.yaml", "mlx_lm.server", "0.31.3", reloads=2, reloads_refused=1)
    record.models["moe"] = ModelState("moe", "/somewhere/moe", True, state="loaded", settings={"budget_gib": 0.00005},
                                      stats=handle.stats())
    record.models["dense"] = ModelState("dense", "/somewhere/dense", False, state="configured")
    ledger, history = CounterLedger(), StatusHistory()
    ledger.observe("moe", "handle", handle_counters(handle))
    counters = {"moe": ledger.totals("moe")}
    history.add(counters)
    out = record.as_dict()
    if pipeline is not None:
        out["pipeline"] = pipeline
    return add_figures(out, history, counters, {"moe": {"in_flight": 1, "queued": 2}},
                       {"moe": {"rss_bytes": 123, "mlx_active_bytes": 45}})


def parse(body: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_of_a_status_document(served):
    _, handle = served
    status = status_document(handle)
    body, content_type = exposition(status)
    assert content_type.startswith("text/plain")
    metrics = parse(body)
    moe = (("model", "moe"),)
    totals, decode = handle.stats()["totals"], handle.stats()["decode"]
    assert metrics[("expert_stream_expert_hits_total", moe)] == totals["hits"] > 0
    assert metrics[("expert_stream_expert_misses_total", moe)] == totals["misses"] > 0
    assert metrics[("expert_stream_read_bytes_total", moe)] == totals["bytes_read"]
    assert metrics[("expert_stream_decode_tokens_total", moe)] == decode["tokens"] == 12
    assert metrics[("expert_stream_slot_bytes", moe)] == handle.budget_bytes
    assert metrics[("expert_stream_slots", moe)] == sum(s.cache.num_slots for s in handle.streams)
    assert metrics[("expert_stream_budget_bytes", moe)] == round(0.00005 * 2**30)
    assert metrics[("expert_stream_requests_in_flight", moe)] == 1
    assert metrics[("expert_stream_requests_queued", moe)] == 2
    assert metrics[("expert_stream_process_resident_bytes", moe)] == 123
    assert metrics[("expert_stream_decode_tokens_per_second", moe)] == 0  # one sample: no rate yet
    assert metrics[("expert_stream_model_state", (("model", "dense"), ("state", "configured")))] == 1
    assert metrics[("expert_stream_reloads_total", (("outcome", "applied"),))] == 2
    assert metrics[("expert_stream_reloads_total", (("outcome", "refused"),))] == 1
    assert list(COUNTER_METRICS) == list(COUNTERS)  # every counter is exported
    assert all(metrics[(f"expert_stream_{name}_total", moe)] == status["models"]["moe"]["counters"][counter]
               for counter, (name, _) in COUNTER_METRICS.items())
    # A stock model has a state, no cache series; no path reaches a label.
    assert not any(("model", "dense") in labels for name, labels in metrics if name != "expert_stream_model_state")
    assert b"/somewhere" not in body


def test_pipeline_metrics_are_per_rank(served):
    """mlx_lm.server's pipeline mode: cache figures carry a rank label, and no rank-less cache
    series sums them again. A group of one rank, through the same all_gather as two."""
    import mlx.core as mx

    from expert_stream.plugin.hosts.mlx_lm.rank_stats import RankStats

    model, handle = served
    ranks = RankStats(mx.distributed.init())
    ranks.exchange(model, handle, "moe")
    status = status_document(handle, pipeline=ranks.status())
    metrics = parse(exposition(status)[0])
    rank0 = (("model", "moe"), ("rank", "0"))
    assert metrics[("expert_stream_expert_hits_total", rank0)] == handle.stats()["totals"]["hits"]
    assert metrics[("expert_stream_slots", rank0)] == sum(s.cache.num_slots for s in handle.streams)
    assert not any(labels == (("model", "moe"),) for name, labels in metrics if "hits" in name)
    row = status["pipeline"]["per_rank"][0]
    assert row["counters"]["decode_tokens"] == handle.stats()["decode"]["tokens"] and row["mlx_active_bytes"] > 0


def test_metrics_allow_is_validated_by_key():
    assert parse_options(Path("h.yaml"), {"metrics_allow": ["10.0.0.5", "10.1.0.0/16", "::1"]}).metrics_allow == \
        ("10.0.0.5/32", "10.1.0.0/16", "::1/128")
    assert parse_options(Path("h.yaml"), {}).metrics_allow == ()
    for bad, why in ((["prometheus.lan"], "'prometheus.lan' is not an IP address or network"),
                     ("10.0.0.5", "must be a list of IP addresses or networks")):
        with pytest.raises(ConfigError, match=re.escape(f"h.yaml: expert_stream.metrics_allow: {why}")):
            parse_options(Path("h.yaml"), {"metrics_allow": bad})


def test_metrics_allow_opens_the_metrics_to_those_addresses_only():
    allowed = allow_list(["10.0.0.0/24"], "test")
    ip_host = {"host": "10.0.0.2:8000"}
    assert refusal("10.0.0.7", ip_host, "0.0.0.0", allowed) is None
    assert refusal("::ffff:10.0.0.7", ip_host, "0.0.0.0", allowed) is None
    assert "loopback" in refusal("10.0.1.7", ip_host, "0.0.0.0", allowed)  # outside the network
    assert "loopback" in refusal("10.0.0.7", ip_host, "0.0.0.0")  # the other endpoints: not allowed
    # An allowed peer still may not come through a proxy, name the server by a (rebindable) DNS
    # name, or be a web page.
    assert "proxy" in refusal("10.0.0.7", {**ip_host, "x-forwarded-for": "1.2.3.4"}, "0.0.0.0", allowed)
    assert "Host header" in refusal("10.0.0.7", {"host": "evil.example:8000"}, "0.0.0.0", allowed)
    assert "Origin" in refusal("10.0.0.7", {**ip_host, "origin": "http://10.0.0.2:8000"}, "0.0.0.0", allowed)
    # Loopback clients keep the rules they had: an IP address in Host is not enough for them.
    assert "Host header" in refusal("127.0.0.1", {"host": "10.0.0.2:8000"}, "0.0.0.0")


def test_the_status_page_is_one_self_contained_file():
    from expert_stream.plugin.hosts.operator_view import page

    body, headers = page()
    text = body.decode()
    assert body == (ROOT / "plugin/hosts/status_page.html").read_bytes()
    assert not re.search(r"https?://", text), "the page loads nothing from elsewhere (it must work offline)"
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", text)
    assert "innerHTML" not in text  # server texts go in as text, never as markup
    scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
    assert len(scripts) == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    policy = headers["Content-Security-Policy"]
    assert f"script-src 'sha256-{digest}'" in policy and "default-src 'none'" in policy
    assert "connect-src 'self'" in policy and headers["X-Frame-Options"] == "DENY"
    assert "/expert-stream/status" in scripts[0]
