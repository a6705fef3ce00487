"""`expert-stream policy-eval`: replay a routing trace through the cache's eviction policies.

    expert-stream policy-eval TRACE.npz --capacity 0.25 [--policies lru,default,...]
                              [--online-budget] [--hindsight 128,512] [--json]

Prints the decode hit rate (%) and misses per decode token of each policy, Belady's optimum as
the ceiling, and the share of the LRU-to-Belady gap (in misses per token) the default policy
closes. ``--online-budget`` adds LRU and the default with slots moved between layers by their
measured hit curves (``policy_sim.simulate_budgeted``); ``--hindsight W`` adds the misses of
the C experts each W decode tokens use most, chosen knowing them (``policy_sim.hindsight_windows``:
what perfect popularity prediction at that window would give). The replay definition is the one documented in
`expert_stream.streaming.lab.policy_sim` (per-layer caches, each token's top-k pinned, decode tokens,
cache carried over requests, mean over layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "policy-eval",
        help="hit rate of the expert-cache eviction policies on a routing trace",
        description="Replay a routing trace (.npz, the format of shared/moe_traces and of "
                    "`expert-stream trace`) through each eviction policy with a per-layer cache "
                    "holding a share of the layer's experts; print decode hit rates (%%) next "
                    "to LRU and Belady's offline optimum.",
    )
    p.add_argument("trace", help="routing trace .npz")
    p.add_argument("--capacity", type=float, default=0.25, metavar="SHARE",
                   help="cache size as a share of a layer's experts, in (0, 1] (default 0.25); "
                        "at least top_k slots")
    p.add_argument("--policies", default=None, metavar="NAMES",
                   help="comma-separated policy names (default: every registered policy); "
                        "lru, default and belady are always included")
    p.add_argument("--online-budget", action="store_true",
                   help="also replay lru and default with online per-layer budgets "
                        "(rows lru+budget, default+budget)")
    p.add_argument("--hindsight", default=None, metavar="W,W,...",
                   help="also report, for each window of W decode tokens, a cache holding the C "
                        "experts that window uses most, chosen knowing them (rows hindsight/W)")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON object {policy: hit %%} on stdout")
    p.add_argument("--include-prefill", action="store_true",
                   help="also replay prefill tokens through the cache (not counted); the "
                        "reference definition replays decode tokens only")
    p.set_defaults(func=run_policy_eval)


def _error(msg: str) -> Exception:
    # the CLI prints ExpertStreamError messages as they are (no traceback) and exits 2
    from expert_stream.streaming.errors import ExpertStreamError
    return ExpertStreamError(msg)


def run_policy_eval(args: argparse.Namespace) -> int:
    from expert_stream.streaming.policy import DEFAULT, POLICIES
    from expert_stream.streaming.lab.policy_sim import (
        capacity_for, gap_closed, hindsight_windows, simulate, simulate_budgeted)
    from expert_stream.streaming.traces import load_trace

    share = float(args.capacity)
    if not (0.0 < share <= 1.0) or math.isnan(share):
        raise _error(f"--capacity must be a share of a layer's experts in (0, 1], got {args.capacity}")
    if args.policies:
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
    else:
        names = list(POLICIES)
    for required in ("lru", "default"):
        if required not in names:
            names.insert(0 if required == "lru" else 1, required)
    names = [n for n in dict.fromkeys(names) if n != "belady"]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise _error(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}, belady")

    windows = []
    for w in filter(None, (args.hindsight or "").split(",")):
        if not w.strip().isdigit() or int(w) < 1:
            raise _error(f"--hindsight takes window sizes in decode tokens (positive integers), got {w!r}")
        windows.append(int(w))

    trace = load_trace(args.trace)           # TraceError (an ExpertStreamError) names file and key
    if trace.decode_mask().sum() == 0 and not args.include_prefill:
        raise _error(f"{args.trace}: no decode tokens (phase == 1) to evaluate")

    rates: dict[str, float] = {}
    per_token: dict[str, float] = {}
    by_class: dict[type, tuple] = {}
    for n in names + ["belady"]:
        cls = POLICIES.get(n)
        if cls is not None and cls in by_class:       # an alias ("default") of a policy done
            rates[n], per_token[n] = by_class[cls]
            continue
        r = simulate(trace, n, share, include_prefill=args.include_prefill)
        rates[n], per_token[n] = float(r["hit_rate"]), float(r["misses_per_token"])
        if cls is not None:
            by_class[cls] = rates[n], per_token[n]
    if args.online_budget:
        for n in ("lru", "default"):
            r = simulate_budgeted(trace, n, share)
            rates[f"{n}+budget"], per_token[f"{n}+budget"] = r["hit_rate"], r["misses_per_token"]
    for w in windows:
        r = hindsight_windows(trace, share, w)
        rates[f"hindsight/{w}"], per_token[f"hindsight/{w}"] = r["hit_rate"], r["misses_per_token"]

    if args.json:
        json.dump(rates, sys.stdout)
        sys.stdout.write("\n")
        return 0

    C = capacity_for(share, int(trace.num_experts), trace.top_k)
    n_dec = int(trace.decode_mask().sum())
    print(f"trace    {args.trace}")
    print(f"         {trace.num_layers} MoE layers, {trace.num_experts} experts, top-{trace.top_k}, "
          f"{trace.num_tokens} tokens ({n_dec} decode)")
    print(f"capacity {share:.0%} of a layer's experts = {C} slots per layer"
          + (" (prefill replayed, not counted)" if args.include_prefill else ""))
    print()
    labels = {n: (f"{n} (= {DEFAULT})" if n == "default" else n) for n in rates}
    width = max(len(v) for v in labels.values()) + 2
    print(f"{'policy':<{width}}{'hit %':>8}{'misses/token':>14}")
    for n, r in rates.items():
        print(f"{labels[n]:<{width}}{r:>8.2f}{per_token[n]:>14.3f}")
    g = gap_closed(-per_token["default"], -per_token["lru"], -per_token["belady"])
    print()
    if math.isnan(g):
        print("LRU already equals Belady here: no gap to close.")
    else:
        print(f"default closes {100 * g:.1f}% of the LRU-to-Belady gap in misses per token "
              f"({per_token['lru']:.3f} -> {per_token['default']:.3f}; "
              f"Belady {per_token['belady']:.3f})")
    return 0
