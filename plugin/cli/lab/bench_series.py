"""`expert-stream bench ... --variant NAME:KEY=VALUE --rounds N`: a series' figures, one column
per variant, each with its ratio to the first (streaming/lab/series.py runs it)."""

from __future__ import annotations



def budget_text(budget) -> str:
    return f"{budget} GiB" if isinstance(budget, (int, float)) else f"{budget}"


def exactness_text(e: dict) -> str:
    if not e.get("checked"):
        return f"not checked: {e['why']}"
    first = e.get("first_differing_step", e.get("first_differing"))
    text = f"{e['steps_equal']}/{e['steps_compared']} decode steps' logits bitwise equal to stock mlx-lm's"
    if first is None:
        return text
    where = f"round {first['round']}, step {first['step']}" if isinstance(first, dict) else f"step {first}"
    return text + f"; first differing: {where}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(value) -> str:
    return "" if value is None else f" (x{value:.2f})"


def print_series(s: dict) -> None:
    variants = s["variants"]
    first = variants[0]["name"]
    done = [r for v in variants for r in v["runs"] if r.get("result") != "killed"]
    any_run = done[0] if done else {}
    load = s["load_average"]
    head = [
        ("workload", s["workload"]),
        ("model", f"{s['model_dir']}; budget {budget_text(s['budget_gib'])}"
                  + (f" -> {min(any_run['slots_per_layer'])}-{max(any_run['slots_per_layer'])} slots per layer"
                     if any_run else "")),
        ("tokens", f"{any_run.get('prompt_tokens')} prompt + {any_run.get('gen_tokens')} decode" if any_run else "-"),
        ("series", f"{s['rounds']} round(s), variants alternating, the order reversed each round; "
                   "page cache dropped before each timed run"),
        ("load average", f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after (1 min; "
                         f"{load['before'][1]:.2f} / {load['after'][1]:.2f} over 5 min)"),
        ("stock", f"{s['stock_tok_s']:.2f} tok/s, every expert resident" if s["stock_tok_s"] else "not run"),
    ]
    width = max(len(k) for k, _ in head)
    for key, value in head:
        print(f"{key:<{width}}  {value}")
    print()

    replay = s["workload"].startswith("replay")
    rows = [("variant", [v["name"] for v in variants])]
    rows.append(("settings", [", ".join(f"{k}={val}" for k, val in v["settings"].items()) or "-" for v in variants]))

    def add(label, cell):
        rows.append((label, [cell(v["summary"], v["summary"]["ratio_to_first"]) for v in variants]))

    add("decode tok/s", lambda m, r: _num(m["decode_tok_s"], ".2f") + _ratio(r["decode_tok_s"]))
    add(f"  rounds / ratio to {first}", lambda m, r: " ".join(_num(x, ".2f") for x in m["decode_tok_s_rounds"])
        + (" / " + " ".join(f"{x:.2f}" for x in r["decode_tok_s_rounds"]) if r["decode_tok_s_rounds"] else ""))
    add("prefill tok/s", lambda m, r: _num(m["prefill_tok_s"], ".1f"))
    add("misses/token", lambda m, r: _num(m["misses_per_token"], ".1f") + _ratio(r["misses_per_token"]))
    add("  read on demand/token", lambda m, r: _num(m["demand_misses_per_token"], ".1f"))
    add("bytes/token", lambda m, r: (_num(m["bytes_per_token"] / 1e6, ".2f") + " MB" if m["bytes_per_token"] is not None
                                     else "-") + _ratio(r["bytes_per_token"]))
    add("lookahead guesses/token", lambda m, r: _num(m["guesses_per_token"], ".1f"))
    add("  guessed right" + (" (replay: cannot know)" if replay else ""),
        lambda m, r: _num(m["guess_hit_rate"] and 100 * m["guess_hit_rate"], ".1f") + ("%" if m["guess_hit_rate"] is not None else ""))
    add("  2+ layers ahead, right", lambda m, r: _num(m["far_guess_hit_rate"] and 100 * m["far_guess_hit_rate"], ".1f")
        + ("%" if m["far_guess_hit_rate"] is not None else ""))
    add("by prediction, of reads needed", lambda m, r: _num(m["by_prediction_share"] and 100 * m["by_prediction_share"], ".1f") + "%")
    add("  of all expert uses", lambda m, r: _num(m["by_prediction_share_of_uses"] and 100 * m["by_prediction_share_of_uses"], ".1f") + "%")
    add("experts read/token", lambda m, r: _num(m["experts_read_per_token"], ".1f"))
    add("  hidden (in before asked)", lambda m, r: _num(m["hidden_share"] and 100 * m["hidden_share"], ".1f")
        + ("%" if m["hidden_share"] is not None else ""))
    add("syncs/token", lambda m, r: _num(m["syncs_per_token"], ".1f"))
    add("  layers reading on demand/token", lambda m, r: _num(m["demand_layers_per_token"], ".1f"))
    add("  ms/token: syncs / read waits / rest", _time_split)
    sim = "replay_" if replay else ""
    add("LRU misses/token (sim)", lambda m, r: _num(m[f"{sim}lru_misses_per_token"], ".1f"))
    add("Belady misses/token (sim)", lambda m, r: _num(m[f"{sim}belady_misses_per_token"], ".1f"))
    add("ratio to stock", lambda m, r: _num(m["ratio_to_stock"], ".2f"))
    add("exactness", lambda m, r: _exact_cell(m))
    add("peak RSS GB", lambda m, r: _num(m["peak_rss_gb"], ".2f"))
    widths = [max(len(label) for label, _ in rows)] + [max(len(row[1][i]) for row in rows) for i in range(len(variants))]
    for label, cells in rows:
        print(f"{label:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths[1:])))
    for v in variants:
        e = v["summary"].get("exactness")
        if e:
            print(f"{v['name']}: {exactness_text(e)}")
        if v["summary"]["killed_rounds"]:
            print(f"{v['name']}: {v['summary']['killed_rounds']} round(s) killed under the memory cap")
    print()


def _time_split(m: dict, r: dict) -> str:
    """A decode token's wall time: waiting for the device (syncs, the compute queued before
    them included), waiting for reads, and the rest (host work between them)."""
    sync, wait, rate = m["sync_per_token_s"], m["read_wait_per_token_s"], m["decode_tok_s"]
    if sync is None or wait is None or not rate:
        return "-"
    return f"{1e3 * sync:.1f} / {1e3 * wait:.1f} / {1e3 * (1 / rate - sync - wait):.1f}"


def _exact_cell(m: dict) -> str:
    e = m.get("exactness")
    if not e:
        agreement = m.get("token_agreement_with_stock")
        return "-" if agreement is None else f"tokens {agreement:.2f}"
    if not e.get("checked"):
        return "not checked"
    return f"{e['steps_equal']}/{e['steps_compared']}"
