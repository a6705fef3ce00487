"""`expert-stream soak`: a seeded chaos soak of a host started through `expert-stream` on
127.0.0.1 (streaming/lab/soak). Exits 1 when any answer was wrong, any request hung or got an
unclear error, or any fault found a failure.

    expert-stream soak --host openai --minutes 10 [--seed N --clients 3 --work DIR]
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "soak", help="chaos soak of a host: requests checked against stock while faults land",
        description="Start a host through expert-stream on 127.0.0.1 with two streamed models and a dense "
                    "one, send a seeded mix of requests from several clients while config edits, SIGHUP "
                    "storms, reloads, kill -9, shard changes, model additions, malformed bodies and "
                    "disconnects land at random times; every answer must equal stock mlx-lm's or be an "
                    "error that names the model. Prints the counts.")
    p.add_argument("--host", choices=("openai", "mlx_lm", "both"), default="both",
                   help="mlx-openai-server (openai), mlx_lm.server (mlx_lm) or both, one after the other")
    p.add_argument("--minutes", type=float, default=10.0, help="how long each host is soaked (default 10)")
    p.add_argument("--seed", type=int, default=None, help="the seed (default: a random one, printed)")
    p.add_argument("--clients", type=int, default=3, help="clients sending at once (default 3)")
    p.add_argument("--deadline", type=float, default=600.0, metavar="S",
                   help="a request without an answer after S seconds counts as a hang (default 600)")
    p.add_argument("--work", default=None, metavar="DIR", help="checkpoints, config and logs (default: a temp dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a streaming setting of every streamed model (repeatable), e.g. --set decode_path=native")
    p.set_defaults(func=run_soak_command)


def run_soak_command(args) -> int:
    from expert_stream.streaming.lab.setting_values import parse_settings
    from expert_stream.streaming.lab.soak import SoakPlan, run_soak

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="expert-stream-soak-"))
    hosts = ("openai", "mlx_lm") if args.host == "both" else (args.host,)
    bad = 0
    for host in hosts:
        plan = SoakPlan(host, args.minutes * 60, seed, work / host, args.clients, args.deadline,
                        settings=parse_settings(args.set))
        summary = run_soak(plan)
        bad += summary["failures"]
    return 1 if bad else 0
