"""`gpu_tool.py profile`: where a streamed decode step's time goes. One model loaded through
`expert_stream.load`, the benchmark's own generation loop (streaming/lab/bench.py: warm-up, page
cache dropped, replayed routing when a trace is given), cProfile on the timed decode only (unless
--top 0); the step's wall split into the engine's read wait, its host syncs (each streamed layer
bringing its routing to the host) and the rest, beside stock mlx-lm's step on the same rows (the
compute with every expert resident) and the disk's rate: the bound max(t_compute, bytes / disk)."""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import time
from pathlib import Path

from tool_common import add_checkpoint_args, budget_for_share, checkpoint_here, parse_pairs, table, write_outputs


def register(sub) -> None:
    p = sub.add_parser("profile", help="where a decode step's time goes (cProfile, read wait, stock step)",
                       description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output folder (profile.json, profile.txt, profile.pstats)")
    add_checkpoint_args(p)
    p.add_argument("--share", type=float, default=0.25, help="share of each layer's experts in the budget")
    p.add_argument("--budget-gib", type=float, default=None, help="the budget itself (overrides --share)")
    p.add_argument("--set", default="", metavar="K=V,...", help="streaming settings, e.g. slot_write=cuda,prefetch=true")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25,
                   help="functions listed by own time and by cumulative time (0: no cProfile, the step untouched by it)")
    p.add_argument("--stock", choices=("yes", "no"), default="yes", help="time stock mlx-lm's step too")
    p.add_argument("--disk-gb", type=float, default=1.0,
                   help="GB read with the engine's reader to measure the disk first (0: not measured, no bound)")
    p.set_defaults(func=main)


class SyncTimer:
    """Times each streamed layer's one sync (decode_paths.route, as streamed_switch calls it)
    while `counting`: its wall time less the read wait inside it (a lookahead's reads awaited
    there are the engine's read wait already). It wraps the function; it changes no behaviour."""

    def __init__(self):
        import expert_stream.streaming.streamed_switch as switch

        self.module, self.original = switch, switch.route
        self.counting, self.seconds, self.calls = False, 0.0, 0

        def timed(store, lookahead, x, indices):
            if not self.counting:
                return self.original(store, lookahead, x, indices)
            waited = store.cache.stats.read_seconds
            t0 = time.perf_counter()
            try:
                return self.original(store, lookahead, x, indices)
            finally:
                self.seconds += time.perf_counter() - t0 - (store.cache.stats.read_seconds - waited)
                self.calls += 1

        switch.route = timed

    def close(self) -> None:
        self.module.route = self.original


def measure_disk(ck: Path, gb: float, settings: dict) -> dict | None:
    """The engine reader's rate on these shards, as `expert-stream bench` measures it."""
    from expert_stream.streaming.lab.disk_bandwidth import measure_read_bandwidth
    from expert_stream.streaming.footprint import checkpoint_footprint

    if gb <= 0:
        return None
    fp = checkpoint_footprint(ck)
    block = max(fp.layer_expert_bytes) // 3 if fp.layer_expert_bytes else 4 << 20
    return measure_read_bandwidth(sorted(ck.glob("model*.safetensors")), block_bytes=max(block, 64 << 10),
                                  total_bytes=int(gb * 1e9), threads=settings.get("reader_threads", 4),
                                  cache_bypass=settings.get("cache_bypass", "auto"))


def _vocab(ck: Path) -> int:
    cfg = json.loads((ck / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


class Run:
    """One timed generation of `model` with the benchmark's loop, replayed if a trace is given."""

    def __init__(self, ck: Path, trace: Path | None, prompt_tokens: int):
        import mlx.core as mx
        import numpy as np

        from expert_stream.streaming.lab.bench import replay_start
        from expert_stream.streaming.footprint import checkpoint_footprint
        from expert_stream.streaming.traces import load_trace

        self.ck, self.fp = ck, checkpoint_footprint(ck)
        self.trace = load_trace(trace) if trace is not None else None
        self.start = replay_start(self.trace, prompt_tokens) if self.trace is not None else 0
        # The bench's prompt: seed 0, ids in [3, vocab - 1).
        self.prompt = mx.array(np.random.default_rng(0).integers(3, _vocab(ck) - 1, prompt_tokens), dtype=mx.int32)

    def generate(self, model, gen_tokens: int, prefill_step: int, on_start=None, on_first=None) -> dict:
        from expert_stream.streaming.lab.bench import timed_generation
        from expert_stream.streaming.lab.page_cache import drop_checkpoint
        from expert_stream.streaming.lab.replay import install

        replay = None
        if self.trace is not None:
            replay = install(model, self.trace, self.fp.model_type, self.fp.num_experts[0], self.fp.top_k, where=str(self.ck))

        def start():
            drop_checkpoint(sorted(self.ck.glob("*.safetensors")))
            if on_start is not None:
                on_start()

        return timed_generation(model, self.prompt, gen_tokens, prefill_step, on_start=start, on_first=on_first,
                                replay=replay, start_row=self.start)


def main(args) -> int:
    import mlx.core as mx

    import expert_stream
    from expert_stream.streaming.lab.setting_values import parse_value

    args.out.mkdir(parents=True, exist_ok=True)
    ck = checkpoint_here(args, args.out)
    budget = args.budget_gib if args.budget_gib is not None else budget_for_share(ck, args.share)[0]
    settings = {k: parse_value(v) for k, v in parse_pairs(args.set, "--set").items()}
    disk = measure_disk(ck, args.disk_gb, settings)
    run = Run(ck, args.trace, args.prompt_tokens)

    model, _, handle = expert_stream.load(ck, budget_gib=budget, **settings)
    prof = cProfile.Profile() if args.top > 0 else None
    syncs = SyncTimer()
    at_first = {}

    def first():
        at_first.update(handle.stats()["totals"])
        at_first["reader"] = (handle.reader.total_bytes, handle.reader.total_seconds)
        syncs.counting = True
        if prof is not None:
            prof.enable()

    try:
        gen = run.generate(model, args.gen_tokens, handle.settings.prefill_step, on_start=handle.reset_stats,
                           on_first=first)
    finally:
        if prof is not None:
            prof.disable()
        syncs.counting = False
        syncs.close()
    totals = handle.stats()["totals"]
    reader = (handle.reader.total_bytes - at_first["reader"][0], handle.reader.total_seconds - at_first["reader"][1])
    slots = sorted({layer["slots"] for layer in handle.stats()["layers"].values()})
    handle.close()
    del model, handle
    gc.collect()
    mx.clear_cache()

    steps = max(len(gen["tokens"]) - 1, 1)
    per = lambda key: (totals[key] - at_first.get(key, 0)) / steps  # noqa: E731
    step_ms = 1e3 * gen["decode_s"] / steps
    read_ms = 1e3 * per("read_seconds")
    sync_ms = 1e3 * syncs.seconds / steps
    figures = {"checkpoint": str(ck), "trace": str(args.trace) if args.trace else None, "budget_gib": budget,
               "slots_per_layer": slots, "settings": settings, "device": str(mx.default_device()),
               "decode_tok_s": gen["decode_tok_s"], "step_ms": step_ms, "read_wait_ms": read_ms,
               "sync_ms": sync_ms, "syncs_per_token": syncs.calls / steps, "rest_ms": step_ms - read_ms - sync_ms,
               "misses_per_token": per("misses"), "bytes_per_token": per("bytes_read"),
               "read_gbps_run": reader[0] / reader[1] / 1e9 if reader[1] > 0 else None,
               "disk_gbps": disk["gbps"] if disk else None, "cprofile_on": prof is not None}
    if args.stock == "yes":
        from mlx_lm.utils import load_model

        stock, _ = load_model(ck)
        s = run.generate(stock, args.gen_tokens, int(settings.get("prefill_step", 2048)))
        figures["stock_step_ms"] = 1e3 * s["decode_s"] / max(len(s["tokens"]) - 1, 1)
        figures["beyond_stock_ms"] = step_ms - figures["stock_step_ms"]
        figures["beyond_stock_and_reads_ms"] = figures["beyond_stock_ms"] - read_ms
        del stock
        if disk:
            # The bound a token cannot beat: its compute or its bytes at the disk's rate.
            figures["t_disk_ms"] = figures["bytes_per_token"] / (disk["gbps"] * 1e9) * 1e3
            figures["bound_ms"] = max(figures["stock_step_ms"], figures["t_disk_ms"])
            figures["ratio_to_bound"] = figures["bound_ms"] / step_ms

    listings = {}
    if prof is not None:
        prof.dump_stats(str(args.out / "profile.pstats"))
        for order in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.top)
            listings[order] = s.getvalue()
    rows = [["decode", f"{figures['decode_tok_s']:.2f} tok/s", f"{step_ms:.2f} ms per step"
             + (" (cProfile on: slower than without)" if prof is not None else "")],
            ["engine read wait", f"{read_ms:.2f} ms", f"{figures['misses_per_token']:.1f} misses, "
             f"{figures['bytes_per_token'] / 1e6:.2f} MB per token"
             + (f", reader {figures['read_gbps_run']:.2f} GB/s" if figures["read_gbps_run"] else "")],
            ["host syncs", f"{sync_ms:.2f} ms", f"{figures['syncs_per_token']:.0f} a token: each streamed layer's "
             "routing to the host (the device's queued work since the last one included)"],
            ["the rest", f"{figures['rest_ms']:.2f} ms", "Python, graph building, slot writes, compute after the last sync"]]
    if "stock_step_ms" in figures:
        rows += [["stock step (t_compute)", f"{figures['stock_step_ms']:.2f} ms", "every expert resident, same rows"],
                 ["beyond stock and reads", f"{figures['beyond_stock_and_reads_ms']:.2f} ms", "the engine's own cost"]]
    if "bound_ms" in figures:
        rows += [["t_disk", f"{figures['t_disk_ms']:.2f} ms", f"bytes per token at the disk's {disk['gbps']:.2f} GB/s"],
                 ["ratio to bound", f"{figures['ratio_to_bound']:.2f}", "max(t_compute, t_disk) / step"]]
    text = (f"checkpoint {ck}, budget {budget} GiB ({slots} slots per layer), trace {args.trace or 'none'}, "
            f"device {figures['device']}\n" + table(["", "time", "what"], rows)
            + ("\ncProfile of the timed decode, by own time:\n" + listings["tottime"]
               + "\nby cumulative time:\n" + listings["cumtime"] if listings else ""))
    write_outputs(args.out, "profile", {**figures, "disk": disk, "cprofile": listings}, text)
    return 0
