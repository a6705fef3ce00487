"""The timed decode's counters (benchmark lab code): the engine's per-layer stats when the first
token is out and at the end, turned into what the decode tokens read and how the lookahead did.

- by prediction: expert uses served by an expert the lookahead read ahead (in a slot when the
  layer looked it up, first use since its read, or copied from the side buffer), against the
  uses that needed a read (those plus the demand misses), and against all expert uses;
- syncs: the compute thread's waits for the device per token, and their time, beside the
  time it waited for reads (the rest of a token's wall time is host work and compute queued
  between syncs);
- hidden: experts read (lookahead and demand alike) whose bytes were in when the compute thread
  came for them, against those it waited for.
"""

from __future__ import annotations

COUNTS = ("hits", "misses", "bytes_read", "read_seconds", "guesses", "guess_hits", "prefetch_reads",
          "prefetch_hits", "reads_landed", "reads_waited", "skipped_misses", "bypassed", "guess_buffer_hits",
          "far_guesses", "far_guess_hits", "syncs", "sync_seconds", "demand_calls")


def per_layer_deltas(before: dict, after: dict) -> dict[str, dict]:
    """{layer: {counter: after - before}} from two `handle.stats()["layers"]`."""
    return {name: {k: now[k] - before[name].get(k, 0) for k in COUNTS} for name, now in after.items()}


def summed(per_layer: dict[str, dict]) -> dict:
    return {k: sum(layer[k] for layer in per_layer.values()) for k in COUNTS}


def _share(part, whole):
    return part / whole if whole else None


def lookahead_figures(per_layer: dict[str, dict], tokens: int, layers_off: int, replayed: bool) -> dict:
    t = summed(per_layer)
    uses = t["hits"] + t["misses"]
    # A miss served from the side buffer is counted as a miss by the cache and as a prefetch hit.
    demand = t["misses"] - t["guess_buffer_hits"]
    return {
        "guesses": t["guesses"],
        "guess_hits": t["guess_hits"],
        "guess_hit_rate": _share(t["guess_hits"], t["guesses"]),
        "guesses_per_token": t["guesses"] / tokens,
        "prefetch_reads": t["prefetch_reads"],
        "prefetch_used": t["prefetch_hits"],
        "by_prediction": t["prefetch_hits"],
        "from_side_buffer": t["guess_buffer_hits"],
        "by_prediction_share": _share(t["prefetch_hits"], t["prefetch_hits"] + demand),
        "demand_misses_per_token": demand / tokens,
        "far_guesses_per_token": t["far_guesses"] / tokens,
        "far_guess_hit_rate": _share(t["far_guess_hits"], t["far_guesses"]),
        "by_prediction_share_of_uses": _share(t["prefetch_hits"], uses),
        "layers_off": layers_off,
        "guess_hit_rate_per_layer": {name: round(d["guess_hits"] / d["guesses"], 3)
                                     for name, d in per_layer.items() if d["guesses"]},
        # The probe applies the model's own router: under replay it cannot know the route.
        "note": "router-based guesses; under replay the router cannot know the replayed route" if replayed else "",
    }


def read_figures(per_layer: dict[str, dict], tokens: int) -> dict:
    t = summed(per_layer)
    read = t["reads_landed"] + t["reads_waited"]
    return {
        "experts_read": read,
        "experts_read_per_token": read / tokens,
        "hidden": t["reads_landed"],
        "waited": t["reads_waited"],
        "hidden_share": _share(t["reads_landed"], read),
        "syncs_per_token": t["syncs"] / tokens,
        # layers a token reads from the shards on demand: what a whole-token graph on predicted
        # routing would have to redo from (each at least one more sync)
        "demand_layers_per_token": t["demand_calls"] / tokens,
        "sync_per_token_s": t["sync_seconds"] / tokens,
        "read_wait_per_token_s": t["read_seconds"] / tokens,
    }
