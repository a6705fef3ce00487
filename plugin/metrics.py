"""GET /expert-stream/metrics: the status document in the Prometheus text format, written by
prometheus_client. A collector over one status document per scrape (no global metric objects):
each scrape shows the state of that moment, and nothing registers twice across reloads.

Labels: `model` (the served name); in mlx_lm.server's pipeline mode the cache figures are per
rank (`model`, `rank`) and the model carries no rank-less cache series (summing them would count
twice). Counters are the ledger's (live_figures): monotonic per served name across reloads and
restarts of its model."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


PREFIX = "expert_stream_"
GIB = 1 << 30

# counter -> (metric name without prefix and _total, help)
COUNTER_METRICS = {
    "hits": ("expert_hits", "Expert uses served from a slot (an expert counts once per layer call)"),
    "misses": ("expert_misses", "Expert uses that had to be read from the checkpoint"),
    "evictions": ("evictions", "Experts evicted from a slot"),
    "bytes_read": ("read_bytes", "Expert bytes read from the checkpoint"),
    "read_seconds": ("read_wait_seconds", "Seconds the compute thread waited for expert reads"),
    "guesses": ("lookahead_guesses", "Experts the lookahead guessed for the next layer"),
    "guess_hits": ("lookahead_guess_hits", "Guessed experts that the next layer then used"),
    "prefetch_reads": ("prefetch_reads", "Reads of guessed experts"),
    "prefetch_hits": ("prefetch_used", "Reads of guessed experts that a later call used"),
    "syncs": ("routing_syncs", "Waits of the host for a layer's routing (one a streamed layer call)"),
    "sync_seconds": ("routing_sync_seconds", "Seconds the host waited for routing"),
    "decode_tokens": ("decode_tokens", "Decode steps (tokens generated one at a time)"),
    "decode_seconds": ("decode_seconds", "Seconds the decode steps took"),
    "decode_bytes": ("decode_read_bytes", "Expert bytes read during decode steps"),
    # beside the prefill_* gauges (a running prefill); a prompt cache's hit is never prefilled
    "prompt_tokens_prefilled": ("prompt_tokens_prefilled", "Prompt tokens that went through the streamed layers "
                                "(prefill chunks; not those the host's prompt cache held)"),
}


def exposition(status: dict) -> tuple[bytes, str]:
    """(body, content type) of a scrape of `status` (the host's status document)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class StatusCollector:
    def __init__(self, status: dict):
        self.status = status

    def collect(self):
        status = self.status
        pipeline = status.get("pipeline")
        ranked = bool(pipeline and pipeline.get("per_rank"))
        labels = ["model", "rank"] if ranked else ["model"]
        counters = {k: CounterMetricFamily(PREFIX + name, text, labels=labels)
                    for k, (name, text) in COUNTER_METRICS.items()}
        gauge = _Gauges(labels)
        per_model = _Gauges(["model"])
        state = GaugeMetricFamily(PREFIX + "model_state", "The model's state (1 for the state it is in)",
                                  labels=["model", "state"])
        restarts = CounterMetricFamily(PREFIX + "restarts", "Times the model's process died and was started again",
                                       labels=["model"])
        for name, model in status["models"].items():
            state.add_metric([name, model["state"]], 1)
            if model.get("restarts_total") is not None:
                restarts.add_metric([name], model["restarts_total"])
            requests = model.get("requests")
            if requests:
                per_model.add("requests_in_flight", "Requests being answered", name, requests["in_flight"])
                per_model.add("requests_queued", "Requests waiting for their turn or for the model to load",
                              name, requests["queued"])
            if not model.get("streamed"):
                continue
            budget = budget_bytes(model)
            if budget is not None:
                per_model.add("budget_bytes", "The slot budget of the model", name, budget)
            rates = model.get("rates") or {}
            per_model.add("decode_tokens_per_second", "Decode speed over the last minute of samples "
                          "(0 when nothing was decoded in it)", name, rates.get("tokens_per_second") or 0.0)
            per_model.add("decode_path_native", "1 where decode tokens resolve their routing inside the graph "
                          "(decode_path native), 0 on the Python path", name,
                          int((model.get("stats") or {}).get("decode_path") == "native"))
            prefill = (model.get("stats") or {}).get("prefill") or {}  # a long prompt in progress: not stuck
            for field, text in PREFILL_GAUGES.items():
                per_model.add(f"prefill_{field}", text, name, prefill.get(field, 0))
            for rank, figures in _cache_figures(name, model, pipeline if ranked else None):
                key = [name, str(rank)] if ranked else [name]
                for counter, value in (figures.get("counters") or {}).items():
                    counters[counter].add_metric(key, value)
                for field, text in GAUGES.items():
                    if figures.get(field) is not None:
                        gauge.add(field, text, key, figures[field])
        yield state
        if restarts.samples:  # a host that restarts model processes (mlx-openai-server)
            yield restarts
        yield from counters.values()
        yield from gauge.families()
        yield from per_model.families()
        reloads = CounterMetricFamily(PREFIX + "reloads", "Config reloads, by outcome", labels=["outcome"])
        reloads.add_metric(["applied"], status.get("reloads", 0))
        reloads.add_metric(["refused"], status.get("reloads_refused", 0))
        yield reloads


# prompt_pass.PrefillProgress fields -> help (0 while no layer-major prefill runs)
PREFILL_GAUGES = {
    "tokens_done": "Prompt tokens of the running prefill that every layer is done with",
    "tokens_total": "Prompt tokens of the running prefill",
    "bytes_read": "Expert bytes the running prefill has read so far",
}

GAUGES = {
    "slots": "Expert slots of the streamed layers",
    "slot_bytes": "Bytes of slot memory allocated",
    "streamed_layers": "MoE layers whose experts stream",
    "resident_layers": "MoE layers kept wholly in memory",
    "process_resident_bytes": "Resident set of the process serving the model",
    "mlx_active_bytes": "MLX's active memory in the process serving the model",
}


def _cache_figures(name: str, model: dict, pipeline):
    """(rank or None, figures) for each process holding a part of the model's cache."""
    if pipeline is None:
        stats = model.get("stats") or {}
        memory = model.get("memory") or {}
        yield None, {"counters": model.get("counters"), "slots": slot_count(stats), "slot_bytes": stats.get("slot_bytes"),
                     "streamed_layers": stats.get("streamed_layers"), "resident_layers": stats.get("resident_layers"),
                     "process_resident_bytes": memory.get("rss_bytes"), "mlx_active_bytes": memory.get("mlx_active_bytes")}
        return
    if pipeline.get("model") != name:
        return
    for row in pipeline["per_rank"]:
        if row.get("loaded"):
            yield row["rank"], {"counters": row.get("counters"), "slots": row.get("slots"),
                                "slot_bytes": row.get("slot_bytes"), "streamed_layers": row.get("streamed_layers"),
                                "resident_layers": row.get("resident_layers"),
                                "process_resident_bytes": row.get("rss_bytes"),
                                "mlx_active_bytes": row.get("mlx_active_bytes")}


def slot_count(stats: dict):
    layers = stats.get("layers")
    return sum(layer.get("slots", 0) for layer in layers.values()) if layers else None


def budget_bytes(model: dict):
    """The budget the model runs with: what its handle reports when it chose one (`budget_gib:
    auto`), else the setting."""
    stats = model.get("stats") or {}
    for key in ("budget_bytes", "budget"):
        if isinstance(stats.get(key), (int, float)):
            return stats[key]
    budget = (model.get("settings") or {}).get("budget_gib")
    return round(budget * GIB) if isinstance(budget, (int, float)) else None


class _Gauges:
    """Gauge families made on first use (a family with no sample is left out)."""

    def __init__(self, labels):
        self.labels = labels
        self._families: dict[str, GaugeMetricFamily] = {}

    def add(self, field: str, text: str, key, value) -> None:
        key = [key] if isinstance(key, str) else key
        if field not in self._families:
            self._families[field] = GaugeMetricFamily(PREFIX + field, text, labels=self.labels)
        self._families[field].add_metric(key, value)

    def families(self):
        return self._families.values()
