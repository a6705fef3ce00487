"""Several variants of the streamed engine side by side (benchmark lab code).

A speed comparison is only fair within one series of runs on the same machine moment: the
variants (streaming settings over the run's own, e.g. `off: prefetch=false`) run alternately,
in rounds whose order reverses each time (A B, B A, A B, ...) so that a drift of the machine's
load weighs on every variant alike; each run is a fresh load of the model with the page cache
dropped before it is timed. Stock mlx-lm runs once after them (when it runs), as the
everything-resident reference and, teacher-forced, the logits every run is compared with.
Each variant's figures are the median over its rounds; its speed ratio to the first variant is
the median of the per-round ratios (the first variant's run of the same round).
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import SettingsError
from ..settings import StreamSettings
from .bench import BenchConfig, apply_stock, finish, stock_reference, stock_wanted, without_stock, workload_label


@dataclass(frozen=True)
class Variant:
    name: str
    settings: dict  # streaming settings over the series' own; budget_gib overrides its budget


def check_variants(variants: list[Variant], cfg: BenchConfig) -> None:
    """Refuse duplicate names and settings the engine would refuse, before anything runs."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SettingsError(f"--variant names must differ; got {', '.join(names)}")
    for v in variants:
        StreamSettings.from_mapping({"budget_gib": cfg.budget_gib, **cfg.settings, **v.settings},
                                    where=f"--variant {v.name}")


def run_series(cfg: BenchConfig, variants: list[Variant], rounds: int, run_one: Callable[[BenchConfig], dict],
               log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """Every variant `rounds` times, alternately, through `run_one` (bench.run_streamed's report,
    in this process or under a memory cap); then stock; then each variant's figures and ratios."""
    from ..footprint import checkpoint_footprint

    check_variants(variants, cfg)
    want_stock = stock_wanted(cfg, checkpoint_footprint(cfg.model_dir))
    base = replace(cfg, stock="yes" if want_stock else "no")
    load_before = list(os.getloadavg())
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            log(f"round {r + 1}/{rounds}, variant {v.name}")
            settings = {**cfg.settings, **v.settings}
            budget = settings.pop("budget_gib", cfg.budget_gib)
            report = run_one(replace(base, settings=settings, budget_gib=budget))
            report["variant"], report["round"] = v.name, r + 1
            runs[v.name].append(report)
            if report.get("result") == "killed":
                continue
            # The disk and the compute floor do not depend on the variant: measure them once.
            base = replace(base, disk_gbps=report["disk_gbps"])
            if not want_stock and base.known_t_compute is None:
                base = replace(base, known_t_compute=(report["t_compute_s"], report["t_compute_source"]))
    stock = stock_reference(cfg, log) if want_stock else None
    for reports in runs.values():
        for report in reports:
            if report.get("result") == "killed":
                continue
            if stock is not None:
                apply_stock(report, stock)
            else:
                without_stock(report, cfg)
            finish(report)
    out = {
        "workload": workload_label(cfg),
        "model_dir": str(cfg.model_dir),
        "budget_gib": cfg.budget_gib,
        "rounds": rounds,
        "order": "alternating, reversed each round",
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "stock_tok_s": stock["decode_tok_s"] if stock is not None else None,
        "variants": [],
    }
    first = runs[variants[0].name]
    for v in variants:
        summary = summarize(runs[v.name])
        summary["ratio_to_first"] = ratios(runs[v.name], first)
        out["variants"].append({"name": v.name, "settings": v.settings, "summary": summary, "runs": runs[v.name]})
    return out


# Figures of a run that a series summarizes (median over rounds), by where they sit in its report.
FIGURES = {
    "decode_tok_s": ("decode_tok_s",),
    "prefill_tok_s": ("prefill_tok_s",),
    "misses_per_token": ("misses_per_token",),
    "bytes_per_token": ("bytes_per_token",),
    "guesses_per_token": ("lookahead", "guesses_per_token"),
    "guess_hit_rate": ("lookahead", "guess_hit_rate"),
    "by_prediction_share": ("lookahead", "by_prediction_share"),
    "by_prediction_share_of_uses": ("lookahead", "by_prediction_share_of_uses"),
    "demand_misses_per_token": ("lookahead", "demand_misses_per_token"),
    "far_guess_hit_rate": ("lookahead", "far_guess_hit_rate"),
    "syncs_per_token": ("reads", "syncs_per_token"),
    "demand_layers_per_token": ("reads", "demand_layers_per_token"),
    "sync_per_token_s": ("reads", "sync_per_token_s"),
    "read_wait_per_token_s": ("reads", "read_wait_per_token_s"),
    "experts_read_per_token": ("reads", "experts_read_per_token"),
    "hidden_share": ("reads", "hidden_share"),
    "lru_misses_per_token": ("recorded", "sim_misses_per_token", "lru"),
    "belady_misses_per_token": ("recorded", "sim_misses_per_token", "belady"),
    "replay_lru_misses_per_token": ("routing", "sim_misses_per_token", "lru"),
    "replay_belady_misses_per_token": ("routing", "sim_misses_per_token", "belady"),
    "ratio_to_stock": ("ratio_to_stock",),
    "token_agreement_with_stock": ("token_agreement_with_stock",),
    "peak_rss_gb": ("peak_rss_gb",),
}


def figure(report: dict, where: tuple):
    value = report
    for key in where:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(reports: list[dict]) -> dict:
    done = [r for r in reports if r.get("result") != "killed"]
    out = {name: _median([figure(r, where) for r in done]) for name, where in FIGURES.items()}
    out["decode_tok_s_rounds"] = [r.get("decode_tok_s") for r in reports]
    out["killed_rounds"] = len(reports) - len(done)
    checked = [r for r in done if r.get("exactness", {}).get("checked")]
    if checked:
        differ = [r for r in checked if r["exactness"]["first_differing_step"] is not None]
        out["exactness"] = {
            "checked": True,
            "steps_compared": sum(r["exactness"]["steps_compared"] for r in checked),
            "steps_equal": sum(r["exactness"]["steps_equal"] for r in checked),
            "first_differing": ({"round": differ[0]["round"], "step": differ[0]["exactness"]["first_differing_step"]}
                                if differ else None),
        }
    else:
        out["exactness"] = next((r["exactness"] for r in done if "exactness" in r), None)
    return out


def ratios(reports: list[dict], first: list[dict]) -> dict:
    """Speed against the first variant's run of the same round; counts against its median."""
    per_round = [r["decode_tok_s"] / f["decode_tok_s"] for r, f in zip(reports, first)
                 if r.get("decode_tok_s") and f.get("decode_tok_s")]
    mine, theirs = summarize(reports), summarize(first)
    counts = {}
    for name in ("misses_per_token", "bytes_per_token"):
        a, b = mine[name], theirs[name]
        counts[name] = a / b if a is not None and b else None
    return {"decode_tok_s": _median(per_round), "decode_tok_s_rounds": per_round, **counts}
