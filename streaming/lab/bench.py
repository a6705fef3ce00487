"""The speed benchmark: one run that measures a streamed model against its own bound and, when
the checkpoint fits in memory, against stock mlx-lm on the same prompt.

bound = 1 / max(t_compute, miss_bytes_per_token / disk_bandwidth): a token cannot be faster
than its compute with every expert resident, nor than the disk can deliver its misses.
t_compute comes from stock mlx-lm when the model fits, otherwise from the streamed model with
forced hits (every expert treated as resident: same kernels, no reads).

With a routing trace (`routing`), every MoE layer of both models routes as the trace's trained
model did (streaming/lab/replay.py), and the report adds what LRU and Belady would have missed on
the same rows (streaming/lab/replay_sim.py). With a text file (`corpus`) the decode is
teacher-forced over the file's tokens and the model's own router decides
(streaming/lab/teacher_forced.py): the routing is recorded and simulated likewise
(streaming/lab/recorded_sim.py), and every step's logits are compared bitwise with stock's.
Before every timed run the checkpoint's pages are dropped from the page cache
(streaming/lab/page_cache.py); a memory cap runs the streamed side in a cgroup
(streaming/lab/capped_bench.py); several settings side by side run as a series
(streaming/lab/series.py).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .decode_counts import lookahead_figures, per_layer_deltas, read_figures, summed
from .disk_bandwidth import measure_read_bandwidth
from ..footprint import checkpoint_footprint
from .page_cache import drop_checkpoint
from ..settings import GIB

# Stock runs only when the checkpoint, its KV cache and MLX temporaries fit with this headroom.
STOCK_HEADROOM_BYTES = 4 * GIB
# Decode steps of the warm-up generation that precedes each timed one (default).
WARMUP_DECODE_STEPS = 8


@dataclass
class BenchConfig:
    model_dir: Path
    budget_gib: float | str  # GiB, or what else the engine's budget_gib accepts
    prompt_tokens: int = 512
    gen_tokens: int = 64
    settings: dict = field(default_factory=dict)  # StreamSettings fields besides budget_gib
    stock: str = "auto"  # "auto": when it fits in memory; "yes"; "no"
    disk_bytes: int = 1 << 30  # read to measure the disk's bandwidth
    seed: int = 0
    # (seconds, source) of t_compute measured by an earlier run on the same model (a sweep).
    known_t_compute: tuple[float, str] | None = None
    routing: Path | None = None  # a routing trace (.npz) to replay through every MoE layer
    trace_start: int | None = None  # its row of the first prompt token (None: see replay_start)
    corpus: Path | None = None  # a text file to decode teacher-forced (the model's own routing)
    disk_gbps: float | None = None  # the disk's bandwidth measured by an earlier run (a series)
    warmup_steps: int = WARMUP_DECODE_STEPS  # decode steps of the warm-up before each timed run


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _prompt(vocab: int, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, vocab - 1, n), dtype=mx.int32)


def timed_generation(model, prompt: mx.array, gen_tokens: int, prefill_step: int, on_start=None, on_first=None,
                     replay=None, start_row: int = 0, warmup_steps: int = WARMUP_DECODE_STEPS) -> dict:
    """Greedy generation through mlx_lm.generate_step (the loop servers run). Prefill time ends
    when the first token is out; decode rate is over the remaining tokens. With `replay` the
    timed generation's first token takes trace row `start_row` and the warm-up the rows just
    before it (a previous request); forwards after the first token are the counted ones."""
    from mlx_lm.generate import generate_step

    # Warm-up: the first calls compile kernels (CUDA, Metal), which neither side should time. On
    # CUDA a fresh process compiled the prefill's kernels for over a minute, so the warm-up runs
    # a prompt of the same length (another one: the expert cache ends up as a previous request
    # leaves it) and a few decode steps.
    if replay is not None:
        replay.begin(start_row - warmup_rows(prompt.size, warmup_steps))
    for _ in generate_step(prompt[::-1], model, max_tokens=warmup_steps, prefill_step_size=prefill_step):
        pass
    if on_start is not None:
        on_start()
    if replay is not None:
        replay.begin(start_row)
    tokens = []
    t0 = time.perf_counter()
    t_first = None
    for token, _ in generate_step(prompt, model, max_tokens=gen_tokens, prefill_step_size=prefill_step):
        tokens.append(int(token))
        if t_first is None:
            t_first = time.perf_counter()
            if replay is not None:
                replay.counting = True
            if on_first is not None:
                on_first()
    t_end = time.perf_counter()
    if replay is not None:
        replay.counting = False
    decode_s = max(t_end - t_first, 1e-9)
    return {
        "tokens": tokens,
        "prefill_s": t_first - t0,
        "prefill_tok_s": prompt.size / (t_first - t0),
        "decode_s": decode_s,
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else 0.0,
    }


def warmup_rows(prompt_tokens: int, warmup_steps: int = WARMUP_DECODE_STEPS) -> int:
    """Trace rows the warm-up generation takes: its prompt and its decode steps."""
    return prompt_tokens + warmup_steps


def replay_start(trace, prompt_tokens: int) -> int:
    """Default trace row of the first prompt token: the timed decode then starts at the trace's
    first decode row after a prompt's length of rows (rows of a prefill pass of a batching
    engine have another locality than decode rows); row 0 where the trace has no phase."""
    if trace.phase is None:
        return 0
    decode = np.flatnonzero(trace.phase[prompt_tokens:] == 1)
    return int(decode[0]) if decode.size else 0


def vocab_size(model) -> int:
    """The vocabulary size; mlx-vlm-layout models keep it on their language model's args."""
    args = getattr(model, "args", None)
    if getattr(args, "vocab_size", None) is None:
        args = model.language_model.args
    return int(args.vocab_size)


class _Routing:
    """The replayed trace of a run, installed alike on every model the run loads."""

    def __init__(self, cfg: BenchConfig, fp):
        from .replay import check_fit
        from ..traces import load_trace

        self.path = Path(cfg.routing)
        self.trace = load_trace(self.path)
        self.fp = fp
        for n in set(fp.num_experts):
            check_fit(self.trace, str(cfg.model_dir), fp.model_type, n, fp.top_k)
        start = cfg.trace_start if cfg.trace_start is not None else replay_start(self.trace, cfg.prompt_tokens)
        self.start = int(start) % self.trace.num_tokens

    def install(self, model):
        from .replay import install

        return install(model, self.trace, self.fp.model_type, self.fp.num_experts[0], self.fp.top_k,
                       where=str(self.fp.model_dir))

    def report(self, replay, handle) -> dict:
        from .replay_sim import phase_share, simulated_misses

        layer_of = {path: i for i, path in enumerate(replay.paths)}
        layers = [(layer_of[s.name], s.cache.num_slots) for s in handle.streams]
        policies = ["lru", "belady"]
        if handle.settings.policy not in policies:
            policies.append(handle.settings.policy)
        return {
            "trace": str(self.path),
            "trace_name": self.trace.name,
            "trace_start": self.start,
            "trace_rows": self.trace.num_tokens,
            "trace_layers": self.trace.num_layers,
            "model_moe_layers": len(replay.columns),
            "num_experts": int(self.trace.num_experts),
            "top_k": self.trace.top_k,
            "decode_rows_from_trace_decode": phase_share(replay),
            "sim_misses_per_token": simulated_misses(replay, layers, policies),
        }


def _shards(model_dir) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = _log) -> dict:
    """The whole benchmark in this process: the streamed side, then stock when it runs."""
    report, run_stock = run_streamed(cfg, log)
    if run_stock:
        apply_stock(report, stock_reference(cfg, log))
    else:
        without_stock(report, cfg)
    return finish(report)


def stock_wanted(cfg: BenchConfig, fp) -> bool:
    import psutil

    stock_fits = fp.total_bytes + STOCK_HEADROOM_BYTES < psutil.virtual_memory().available
    return cfg.stock == "yes" or (cfg.stock == "auto" and stock_fits)


def workload_label(cfg: BenchConfig) -> str:
    """What routed the experts, for every figure of a run: a trained router on a text file, a
    replayed trace, or the model's own routing of greedy tokens."""
    from .synthetic.writer import read_synth

    random_weights = read_synth(cfg.model_dir) is not None
    if cfg.corpus is not None:
        router = "own router (random weights)" if random_weights else "trained router"
        return f"{router}, teacher-forced on {cfg.corpus}"
    if cfg.routing is not None:
        return f"replay of {Path(cfg.routing).name}"
    return "own routing (random weights, greedy)" if random_weights else "own routing (greedy, random prompt)"


class _Watch:
    """What the timed run captures when its first token is out (outside both timings)."""

    def __init__(self, handle):
        self.handle = handle
        self.recorder = None  # TraceRecorder while the run records routing
        self.stats = {}
        self.reader = (0, 0.0)
        self.caches = None  # recorded_sim.CacheState per layer
        self.recorded_rows = 0
        self.rss_first = 0

    def first(self) -> None:
        self.rss_first = _rss_now()
        self.stats = self.handle.stats()
        self.reader = (self.handle.reader.total_bytes, self.handle.reader.total_seconds)
        if self.recorder is not None:
            from .recorded_sim import capture

            self.caches = capture(self.handle)
            self.recorded_rows = self.recorder.tokens


def run_streamed(cfg: BenchConfig, log: Callable[[str], None] = _log) -> tuple[dict, bool]:
    """The streamed side: (report, whether stock should run). t_compute comes from forced hits
    here unless stock will run (or a sweep measured it already)."""
    import expert_stream  # the public load: the generate_step wrapper (prefill_step, layer-major prefill) too

    fp = checkpoint_footprint(cfg.model_dir)
    routing = _Routing(cfg, fp) if cfg.routing is not None else None
    report = {
        "model_dir": str(cfg.model_dir),
        "model_type": fp.model_type,
        "checkpoint_gb": fp.total_bytes / 1e9,
        "expert_gb": fp.expert_bytes / 1e9,
        "trunk_gb": fp.trunk_bytes / 1e9,
        "budget_gib": cfg.budget_gib,
        "prompt_tokens": cfg.prompt_tokens,
        "gen_tokens": cfg.gen_tokens,
        "device": str(mx.default_device()),
        "settings": dict(cfg.settings),
        "workload": workload_label(cfg),
        "load_average": {"before": list(os.getloadavg())},  # 1, 5, 15 minutes; this machine may be shared
    }

    if cfg.disk_gbps is None:
        log(f"disk: reading {cfg.disk_bytes / 1e9:.1f} GB of this checkpoint's shards with the engine's reader")
        block = max(fp.layer_expert_bytes) // 3 if fp.layer_expert_bytes else 4 << 20  # ~ one expert tensor
        disk = measure_read_bandwidth(
            sorted(Path(cfg.model_dir).glob("model*.safetensors")), block_bytes=max(block, 64 << 10),
            total_bytes=cfg.disk_bytes, threads=cfg.settings.get("reader_threads", 4),
            cache_bypass=cfg.settings.get("cache_bypass", "auto"),
        )
        report["disk_gbps"] = disk["gbps"]
    else:
        report["disk_gbps"] = cfg.disk_gbps

    budget = f"{cfg.budget_gib} GiB" if isinstance(cfg.budget_gib, (int, float)) else cfg.budget_gib
    log(f"streamed: budget {budget}, {cfg.prompt_tokens} prompt + {cfg.gen_tokens} generated tokens"
        + (f", replaying {routing.path.name} from row {routing.start}" if routing else "")
        + (f", teacher-forced on {cfg.corpus}" if cfg.corpus else ""))
    model, tokenizer, handle = expert_stream.load(cfg.model_dir, budget_gib=cfg.budget_gib, **cfg.settings)
    replay = routing.install(model) if routing else None
    watch = _Watch(handle)
    page_cache = {}

    def start():
        page_cache.update(drop_checkpoint(_shards(cfg.model_dir)))
        handle.reset_stats()

    if cfg.corpus is not None:
        from .teacher_forced import corpus_tokens, teacher_forced_generation

        tokens = corpus_tokens(cfg.corpus, tokenizer, cfg.prompt_tokens, cfg.gen_tokens)
        with handle.recording() as watch.recorder:
            run = teacher_forced_generation(model, tokens, cfg.prompt_tokens, handle.settings.prefill_step,
                                            on_start=start, on_first=watch.first, warmup_steps=cfg.warmup_steps)
        # Every MoE layer resident (none streamed): nothing to record or simulate.
        report["recorded"] = _recorded_report(watch, handle) if handle.streams else None
        report["_digests"] = run["digests"]  # for exactness against stock; dropped by finish()
    else:
        prompt = _prompt(vocab_size(model), cfg.prompt_tokens, cfg.seed)
        run = timed_generation(
            model, prompt, cfg.gen_tokens, handle.settings.prefill_step,
            on_start=start, on_first=watch.first, replay=replay, start_row=routing.start if routing else 0,
            warmup_steps=cfg.warmup_steps,
        )
    prefill_stats = watch.stats["totals"]
    per_layer = per_layer_deltas(watch.stats["layers"], handle.stats()["layers"])
    decode = summed(per_layer)
    read_bytes = handle.reader.total_bytes - watch.reader[0]
    read_seconds = handle.reader.total_seconds - watch.reader[1]
    decode_tokens = max(len(run["tokens"]) - 1, 1)
    uses = decode["hits"] + decode["misses"]
    lookaheads = [look for layer in handle.layers for look in layer.lookaheads]
    report.update(
        decode_tok_s=run["decode_tok_s"],
        decode_path=handle.decode_path[0],
        prefill_tok_s=run["prefill_tok_s"],
        decode_tokens=decode_tokens,
        hits=decode["hits"],
        misses=decode["misses"],
        miss_rate=decode["misses"] / uses if uses else 0.0,
        misses_per_token=decode["misses"] / decode_tokens,
        bytes_per_token=decode["bytes_read"] / decode_tokens,
        bytes_per_prompt_token=prefill_stats.get("bytes_read", 0) / cfg.prompt_tokens,
        read_wait_per_token_s=decode["read_seconds"] / decode_tokens,
        # The reader's batches in flight per token (their wall time, whether waited for or not).
        read_busy_per_token_s=read_seconds / decode_tokens,
        # The engine's reader during the timed decode: its bytes over its batches' wall time.
        read_gbps_run=read_bytes / read_seconds / 1e9 if read_seconds > 0 else None,
        slots_per_layer=[s.cache.num_slots for s in handle.streams],
        decode_misses_per_layer=[per_layer[s.name]["misses"] for s in handle.streams],
        slot_gb=handle.budget_bytes / 1e9,
        reader=handle.reader.backend,
        cache_bypass=handle.reader.cache_bypass,
        page_cache=page_cache,
        prefill_reads_per_missed_expert=_prefill_reads_per_miss(handle, watch.stats),
        lookahead=lookahead_figures(per_layer, decode_tokens,
                                    sum(1 for look in lookaheads if not look.active),
                                    replayed=routing is not None),
        reads=read_figures(per_layer, decode_tokens),
        peak_rss_gb=peak_rss_bytes() / 1e9,
        # RSS after the timed decode over RSS at its first token: a leak shows here (KV included)
        decode_rss_growth_mb=(_rss_now() - watch.rss_first) / 2**20,
    )
    if routing:
        report["routing"] = routing.report(replay, handle)
    streamed_tokens = run["tokens"]
    report["_tokens"] = streamed_tokens  # for token agreement with stock; dropped by finish()

    run_stock = stock_wanted(cfg, fp)
    if cfg.known_t_compute is not None and not run_stock:
        report["t_compute_s"], report["t_compute_source"] = cfg.known_t_compute
    elif not run_stock:
        why = "does not fit in memory" if cfg.stock == "auto" else "not requested"
        log(f"t_compute: same layers with forced hits (stock mlx-lm {why})")
        with handle.compute_only():
            prompt = _prompt(vocab_size(model), cfg.prompt_tokens, cfg.seed)
            forced = timed_generation(model, prompt[: min(64, prompt.size)], min(cfg.gen_tokens, 32),
                                      handle.settings.prefill_step, on_start=lambda: drop_checkpoint(_shards(cfg.model_dir)),
                                      replay=replay, start_row=routing.start if routing else 0,
                                      warmup_steps=cfg.warmup_steps)
        report["t_compute_s"] = 1 / forced["decode_tok_s"]
        report["t_compute_source"] = "forced_hits"
    exact = handle.settings.exact
    handle.close()
    del model, handle, replay
    gc.collect()
    mx.clear_cache()
    if not exact and not run_stock and cfg.corpus is None:
        log("lossy knobs on: the same run with exact settings, for token agreement")
        exact_settings = {k: v for k, v in cfg.settings.items() if k not in ("top_k_override", "skip_miss_below")}
        model, _, handle = expert_stream.load(cfg.model_dir, budget_gib=cfg.budget_gib, **exact_settings)
        replay = routing.install(model) if routing else None
        exact_run = timed_generation(model, _prompt(vocab_size(model), cfg.prompt_tokens, cfg.seed), cfg.gen_tokens,
                                     handle.settings.prefill_step,
                                     on_start=lambda: drop_checkpoint(_shards(cfg.model_dir)),
                                     replay=replay, start_row=routing.start if routing else 0,
                                     warmup_steps=cfg.warmup_steps)
        report["token_agreement_with_exact"] = _agreement(streamed_tokens, exact_run["tokens"])
        report["exact_decode_tok_s"] = exact_run["decode_tok_s"]
        handle.close()
        del model, handle, replay
        gc.collect()
    report["load_average"]["after"] = list(os.getloadavg())
    return report, run_stock


def _recorded_report(watch: _Watch, handle) -> dict:
    """The routing the timed decode recorded: its expert uses, and what LRU, Belady and the
    engine's own policy would have missed on it from the caches as the decode began."""
    from .recorded_sim import simulated_misses

    rows = watch.recorder.trace().ids[watch.recorded_rows:]
    policies = ["lru", "belady"]
    if handle.settings.policy not in policies:
        policies.append(handle.settings.policy)
    start_slots = [state.slots for state in watch.caches]
    return {
        "decode_rows": int(rows.shape[0]),
        # Distinct experts each layer was routed to, per decode token: the expert uses.
        "expert_uses": int(sum(len(set(row)) for row in rows.reshape(-1, rows.shape[-1]).tolist())),
        "sim_misses_per_token": simulated_misses(rows, watch.caches, policies),
        "slots_at_start": start_slots,
        "slots_moved": start_slots != [s.cache.num_slots for s in handle.streams],
    }


def stock_reference(cfg: BenchConfig, log: Callable[[str], None] = _log) -> dict:
    """Stock mlx-lm on the same prompt (the same replayed rows, or teacher-forced on the same
    tokens): its speed, its tokens and, teacher-forced, its logits' digests."""
    from mlx_lm.utils import load_model, load_tokenizer

    log("stock mlx-lm: same " + ("tokens, teacher-forced" if cfg.corpus else "prompt") + ", every expert resident")
    fp = checkpoint_footprint(cfg.model_dir)
    routing = _Routing(cfg, fp) if cfg.routing is not None else None
    stock, _ = load_model(Path(cfg.model_dir))
    replay = routing.install(stock) if routing else None
    prefill_step = int(cfg.settings.get("prefill_step", 2048))
    drop = lambda: drop_checkpoint(_shards(cfg.model_dir))  # noqa: E731
    if cfg.corpus is not None:
        from .teacher_forced import corpus_tokens, teacher_forced_generation

        tokens = corpus_tokens(cfg.corpus, load_tokenizer(Path(cfg.model_dir)), cfg.prompt_tokens, cfg.gen_tokens)
        run = teacher_forced_generation(stock, tokens, cfg.prompt_tokens, prefill_step, on_start=drop,
                                        warmup_steps=cfg.warmup_steps)
    else:
        run = timed_generation(stock, _prompt(vocab_size(stock), cfg.prompt_tokens, cfg.seed), cfg.gen_tokens,
                               prefill_step, on_start=drop, replay=replay, start_row=routing.start if routing else 0,
                               warmup_steps=cfg.warmup_steps)
    del stock, replay
    gc.collect()
    mx.clear_cache()
    return run


def apply_stock(report: dict, stock: dict) -> None:
    """Stock's figures beside a streamed run's, and what compares the two: the tokens (greedy)
    or every step's logits (teacher-forced)."""
    report["stock_tok_s"] = stock["decode_tok_s"]
    report["stock_prefill_tok_s"] = stock["prefill_tok_s"]
    report["ratio_to_stock"] = report["decode_tok_s"] / stock["decode_tok_s"]
    report["t_compute_s"] = 1 / stock["decode_tok_s"]
    report["t_compute_source"] = "stock"
    if "_digests" in report:
        from .teacher_forced import compare_digests

        report["exactness"] = {"checked": True, **compare_digests(report["_digests"], stock["digests"])}
    else:
        report["token_agreement_with_stock"] = _agreement(report["_tokens"], stock["tokens"])


def without_stock(report: dict, cfg: BenchConfig) -> None:
    """A teacher-forced run that stock did not run beside: its exactness was not checked."""
    if "_digests" in report:
        why = "does not fit in memory" if cfg.stock == "auto" else "was not requested (--stock no)"
        report["exactness"] = {"checked": False, "why": f"stock mlx-lm {why}"}


def finish(report: dict) -> dict:
    """The bounds, from the figures the runs measured."""
    report.pop("_tokens", None)
    report.pop("_digests", None)
    t_disk = report["bytes_per_token"] / (report["disk_gbps"] * 1e9)
    report["t_disk_s"] = t_disk
    report["bound_tok_s"] = 1 / max(report["t_compute_s"], t_disk)
    report["ratio_to_bound"] = report["decode_tok_s"] / report["bound_tok_s"]
    # The share of the read time that compute hid: a layer's reads overlap only its own hits.
    busy = report.get("read_busy_per_token_s") or 0.0
    report["reads_hidden_share"] = max(0.0, 1 - report["read_wait_per_token_s"] / busy) if busy > 0 else None
    # The same bounds at the rate the engine's reader achieved in this run (the disk measured
    # before the run moves a lot on shared machines): the disk alone, and with the compute.
    rate = report.get("read_gbps_run")
    if rate and report["bytes_per_token"] > 0:
        t_disk_run = report["bytes_per_token"] / (rate * 1e9)
        report["disk_bound_tok_s"] = 1 / t_disk_run
        report["ratio_to_disk_bound"] = report["decode_tok_s"] / report["disk_bound_tok_s"]
        report["bound_run_tok_s"] = 1 / max(report["t_compute_s"], t_disk_run)
        report["ratio_to_bound_run"] = report["decode_tok_s"] / report["bound_run_tok_s"]
    else:
        for key in ("disk_bound_tok_s", "ratio_to_disk_bound", "bound_run_tok_s", "ratio_to_bound_run"):
            report[key] = None
    return report


def _agreement(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    return float(np.mean(np.array(a[:n]) == np.array(b[:n]))) if n else 0.0


def _prefill_reads_per_miss(handle, stats_at_first_token: dict) -> float:
    """Bytes read during prefill over the bytes of the experts it missed: 1.0 when each missing
    expert was read once per chunk. mlx-lm builds the first decode step before the first token
    is out, so that step's lookahead reads add a little."""
    size = {p.path: p.expert_bytes for p in handle.plans}
    layers = stats_at_first_token["layers"]
    missed = sum(layers[name]["misses"] * size[name] for name in layers)
    return stats_at_first_token["totals"]["bytes_read"] / missed if missed else 0.0
