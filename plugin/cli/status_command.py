"""`expert-stream status`: a running server's status, once (text or --json) or redrawn in place
(--watch: the status page's figures in the terminal, every --interval seconds; standard library
only: ANSI cursor moves on a terminal, frames one after another otherwise). Ctrl-C ends the
watch; a server that stops answering ends it with a message."""

from __future__ import annotations

import json
import os
import sys
import time

from expert_stream.plugin.cli.server_client import fetch_json, server_url
from expert_stream.streaming.errors import ExpertStreamError


def register(sub) -> None:
    p = sub.add_parser("status", help="ask a running server (started through expert-stream) for its status")
    p.add_argument("--url", default=None, help="the server's base URL (default: the running server started "
                   "through expert-stream, from its run file)")
    p.add_argument("--config", default=None, help="the config the server was started with (picks that server)")
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.add_argument("--reload", action="store_true", help="ask it to reload its config first")
    p.add_argument("--watch", action="store_true", help="redraw the figures in place until Ctrl-C (the terminal's "
                   "view of the status page, GET /expert-stream/ on the server)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between redraws (--watch)")
    p.set_defaults(func=run_status)


def model_line(model_id: str, model: dict) -> str:
    """One model of the status, as `status` prints it."""
    line = f"  {model_id}: {model['state']}"
    if model["streamed"]:
        budget = model.get("budget") or {}
        gib = budget.get("budget_gib", model["settings"]["budget_gib"])
        line += ", streamed, budget auto" if gib == "auto" else \
            f", streamed, budget {gib} GiB" + (" (auto)" if budget.get("auto") else "")
        stats = model.get("stats") or {}
        totals = stats.get("totals")
        layers = stats.get("streamed_layers", 0) + stats.get("resident_layers", 0)
        # A layer whose slots hold all its experts never looks anything up: no hits, no misses.
        held = stats.get("resident_layers", 0) + sum(
            1 for layer in (stats.get("layers") or {}).values()
            if not layer.get("hits") and not layer.get("misses") and layer.get("resident_calls"))
        if totals and not totals["hits"] and not totals["misses"] and held:
            line += f", every expert resident ({layers} MoE layers, nothing read)"
        elif totals:
            line += (f", hit rate {totals['hit_rate']:.1%}, {totals['misses']} misses, "
                     f"{totals['bytes_read'] / 1e9:.3f} GB read")
            if held:
                line += f", {held} of {layers} MoE layers hold every expert"
        if stats.get("decode_path") == "native":
            line += ", decode resolved in the graph (native)"
        elif stats.get("decode_path_note"):
            line += f", decode on the Python path ({stats['decode_path_note']})"
    else:
        line += ", stock"
    if model.get("error"):
        line += f" ({model['error']})"
    return line


def run_status(args) -> int:
    base = server_url(args.url, args.config)
    if args.reload:
        result = fetch_json(base + "/expert-stream/reload", method="POST", timeout=3600)
        print("reload:", "ok" if result.get("ok") else f"refused: {result.get('error')}")
    if args.watch:
        if args.interval <= 0:
            raise ExpertStreamError(f"--interval must be a positive number of seconds, got {args.interval:g}")
        return watch(base, args.interval)
    status = fetch_status(base)
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        print()
        return 0
    print(f"config:   {status['config_path']} ({status['host']} {status['host_version']})")
    print(f"applied:  {(status.get('applied_hash') or '-')[:12]}  reloads: {status['reloads']}"
          + ("  (reloading now)" if status.get("reloading") else ""))
    if status.get("last_error"):
        print(f"error:    {status['last_error']}")
    for model_id, model in status["models"].items():
        print(model_line(model_id, model))
    if status.get("pipeline"):
        print(rank_lines(status["pipeline"]))
    return 0


def rank_lines(pipeline: dict) -> str:
    """Every rank's counters (gathered through mlx.distributed between two requests)."""
    age = pipeline.get("age_seconds")
    lines = [f"pipeline: {pipeline['ranks']} ranks, {pipeline.get('model') or 'no model loaded'}"
             + (f", counters as of {age} s ago" if age is not None else ", no counters yet")]
    for r in pipeline.get("per_rank", []):
        if not r["loaded"]:
            lines.append(f"  rank {r['rank']}: not loaded")
            continue
        lines.append(f"  rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, {r['streamed_layers']} "
                     f"streamed, {r['slot_bytes'] / 2**30:.4f} GiB of slots, hit rate {r['hit_rate']:.1%}, "
                     f"{r['misses']} misses, {r['bytes_read'] / 1e9:.3f} GB read")
    return "\n".join(lines)


SPARKS = "▁▂▃▄▅▆▇█"
HOME, CLEAR_LINE, CLEAR_BELOW, HIDE_CURSOR, SHOW_CURSOR = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[?25l", "\x1b[?25h"


def fetch_status(base: str) -> dict:
    """The server's status, or ExpertStreamError with its reason (no answer, or a refusal)."""
    status = fetch_json(base + "/expert-stream/status", timeout=10)
    if "models" not in status:
        raise ExpertStreamError(f"{base}/expert-stream/status: {status.get('error', status)}")
    return status


def watch(base: str, interval: float, out=sys.stdout) -> int:
    terminal = out.isatty()
    if terminal:
        out.write(HIDE_CURSOR + "\x1b[2J")
    try:
        while True:
            try:
                status = fetch_status(base)
            except ExpertStreamError as exc:
                out.write(f"\nexpert-stream status: the server went away at {time.strftime('%H:%M:%S')}: {exc}\n")
                return 1
            text = frame(status, base, interval, time.time())
            if terminal:
                width = os.get_terminal_size(out.fileno()).columns
                text = HOME + "".join(line[:width] + CLEAR_LINE + "\n" for line in text.splitlines()) + CLEAR_BELOW
            else:
                text += "\n"
            out.write(text)
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if terminal:
            out.write(SHOW_CURSOR)
            out.flush()


def frame(status: dict, base: str, interval: float, now: float) -> str:
    """One screen of the status document."""
    lines = [f"expert-stream  {base}  {status['host']} {status['host_version']}  "
             f"{time.strftime('%H:%M:%S', time.localtime(now))}  (every {interval:g} s; Ctrl-C stops)"]
    last = status.get("last_reload")
    changes = "; ".join(f"{k} {', '.join(last[k])}" for k in ("removed", "changed", "added") if last and last[k])
    lines.append(f"config  {os.path.basename(status['config_path'])}  applied {(status.get('applied_hash') or '-')[:12]}  "
                 f"reloads {status['reloads']} applied, {status.get('reloads_refused', 0)} refused"
                 + ("  (reloading now)" if status.get("reloading") else ""))
    if last:
        lines.append(f"last reload  {last['reason']}: {changes or 'nothing changed'} ({last['seconds']} s)")
    if status.get("last_error"):
        lines.append(f"error  {status['last_error']}")
    lines.append("")
    lines.append(f"{'MODEL':<16} {'STATE':<12} {'BUDGET':>10} {'SLOT MEM':>10} {'RSS':>9} {'RUN/Q':>6} "
                 f"{'TOK/S':>7} {'HIT 1m':>7} {'HIT ALL':>7} {'READ/S':>9} {'READ/TOK':>9}")
    for name, model in status["models"].items():
        lines.append(_model_row(name, model, status.get("history")))
        if model.get("error"):
            lines.append(f"  {model['error']}")
    pipeline = status.get("pipeline")
    if pipeline:
        lines += ["", rank_lines(pipeline)]
    return "\n".join(lines)


def _model_row(name: str, model: dict, history) -> str:
    from expert_stream.plugin.metrics import budget_bytes

    requests = model.get("requests") or {}
    memory = (model.get("memory") or {}).get("rss_bytes")
    run_q = f"{requests.get('in_flight', 0)}/{requests.get('queued', 0)}" if requests else "-"
    row = f"{name[:16]:<16} {model['state'][:12]:<12} "
    if not model.get("streamed"):
        return row + f"{'stock':>10} {'-':>10} {_bytes(memory):>9} {run_q:>6}"
    stats, counters, rates = model.get("stats") or {}, model.get("counters") or {}, model.get("rates") or {}
    uses = counters.get("hits", 0) + counters.get("misses", 0)
    tps = rates.get("tokens_per_second")
    spark = sparkline(history, name)
    return row + (f"{_gib(budget_bytes(model)):>10} {_gib(stats.get('slot_bytes')):>10} {_bytes(memory):>9} "
                  f"{run_q:>6} {('%.2f' % tps) if tps is not None else '-':>7} {_pct(rates.get('hit_rate')):>7} "
                  f"{_pct(counters['hits'] / uses if uses else None):>7} "
                  f"{_bytes(rates.get('read_bytes_per_second')):>9} {_bytes(rates.get('bytes_per_token')):>9}"
                  + (f"\n{'':16} hit rate per {history['interval_s']:g} s, newest last: {spark}" if spark.strip() else "")
                  + _prefill_line(stats.get("prefill")))


def _prefill_line(prefill) -> str:
    """A prefill in progress (a long prompt can take minutes: the server is working, not stuck)."""
    if not prefill:
        return ""
    return (f"\n{'':16} prefill: {prefill['tokens_done']}/{prefill['tokens_total']} tokens, "
            f"{_bytes(prefill['bytes_read'])} read, {prefill['seconds']:.0f} s")


def sparkline(history, name: str, width: int = 24) -> str:
    """The hit rate of each sample interval, newest last (a blank where nothing was looked up)."""
    if not history:
        return ""
    fields = {f: i for i, f in enumerate(history["fields"])}
    samples = [s["models"][name] for s in history["samples"] if name in s["models"]][-(width + 1):]
    marks = []
    for a, b in zip(samples, samples[1:]):
        hits, misses = (b[fields[k]] - a[fields[k]] for k in ("hits", "misses"))
        marks.append(SPARKS[min(len(SPARKS) - 1, int(hits / (hits + misses) * len(SPARKS)))] if hits + misses else " ")
    return "".join(marks)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _gib(n) -> str:
    return _bytes(n) if n is None or n < 2**27 else f"{n / 2**30:.3g} GiB"


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
