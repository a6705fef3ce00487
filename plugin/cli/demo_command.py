"""`expert-stream demo`: the whole path on a fresh machine, in one command.

Makes (once) a synthetic MoE checkpoint whose experts are larger than the budget the demo sets,
writes a mlx-openai-server config for it, starts the host through the plugin on 127.0.0.1 on a
free port, sends one real chat completion, prints the answer and the cache stats from the status
endpoint, and stops the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from expert_stream.streaming.errors import ExpertStreamError

# Small enough to make in seconds and run on a CPU; the budget below holds a quarter of its experts.
DEMO_MODEL = dict(arch="qwen3_moe", layers=4, experts=32, top_k=4, hidden=256, moe_hidden=256,
                  bits=4, dtype="float32", seed=0)
DEMO_SLOTS_PER_LAYER = 8


def register(sub) -> None:
    p = sub.add_parser("demo", help="stream a synthetic MoE model through mlx-openai-server, end to end")
    p.add_argument("--prompt", default="Say hello to expert streaming.")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server to start")
    p.add_argument("--keep-running", action="store_true", help="leave the server running (Ctrl-C stops it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another expert_stream setting for the demo model (e.g. --set policy=lru)")
    p.set_defaults(func=run_demo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_checkpoint() -> Path:
    from expert_stream.plugin.paths import cache_dir
    from expert_stream.streaming.lab.synthetic import make_checkpoint

    return make_checkpoint(cache_dir() / "demo", progress=True, **DEMO_MODEL)


def wait_ready(base: str, process: subprocess.Popen, timeout: float) -> float:
    from tqdm import tqdm

    t0 = time.perf_counter()
    # The host and its model process import mlx-lm, transformers and torch: 30-120 s on 2 cores.
    with tqdm(desc="server starting", unit="s", bar_format="{desc}: {elapsed}", file=sys.stderr) as bar:
        while time.perf_counter() - t0 < timeout:
            if process.poll() is not None:
                raise ExpertStreamError(f"the server exited with code {process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
            bar.update(0)
            bar.refresh()
    raise ExpertStreamError(f"the server did not answer within {timeout:.0f} s")


def chat(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def run_demo(args) -> int:
    from expert_stream.plugin.config import footprint
    from expert_stream.plugin import plugins

    model_dir = demo_checkpoint()
    fp = footprint(model_dir, plugins.architectures())
    budget_gib = round(DEMO_SLOTS_PER_LAYER * fp.bytes_per_slot_row / (1 << 30), 6)
    print(f"checkpoint: {model_dir}: experts {fp.expert_bytes / 1e6:.1f} MB, budget {budget_gib * 1024:.2f} MiB "
          f"({fp.expert_bytes / (budget_gib * (1 << 30)):.0f}x smaller)")
    extra = "".join(f", {item.partition('=')[0]}: {item.partition('=')[2]}" for item in args.set)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="expert-stream-demo-") as tmp:
        config = Path(tmp) / "demo.yaml"
        config.write_text(
            "expert_stream: {enabled: true}\n"
            f"server: {{host: 127.0.0.1, port: {port}, log_level: WARNING}}\n"
            "models:\n"
            f"  - model_path: {model_dir}\n"
            "    served_model_name: demo-moe\n"
            f"    expert_stream: {{budget_gib: {budget_gib}{extra}}}\n"
        )
        command = [sys.executable, "-c", "from expert_stream.plugin.cli import main; raise SystemExit(main())",
                   "serve", "--config", str(config), "--no-log-file"]
        print(f"starting mlx-openai-server through expert-stream on {base} ...", flush=True)
        process = subprocess.Popen(command, cwd=tmp, start_new_session=True)
        try:
            seconds = wait_ready(base, process, args.timeout)
            print(f"server ready in {seconds:.1f} s")
            answer = chat(base, "demo-moe", args.prompt, args.max_tokens)
            print(f"\nprompt: {args.prompt}\nanswer: {answer['choices'][0]['message']['content']!r}")
            print("(random weights: the text is noise; the point is that it streamed)\n")
            stats = model_stats(base, "demo-moe")
            totals = stats.get("totals")
            if totals:
                print(f"cache: hit rate {totals['hit_rate']:.1%}, {totals['hits']} hits, {totals['misses']} misses, "
                      f"{totals['evictions']} evictions, {totals['bytes_read'] / 1e6:.2f} MB read in "
                      f"{totals['read_seconds']:.3f} s; decode on the {stats.get('decode_path', 'python')} path")
            else:
                print("cache: the model process gave no statistics within 30 s")
            if args.keep_running:
                print("server keeps running; Ctrl-C stops it")
                process.wait()
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    print("server stopped")
    return 0


def model_stats(base: str, model: str, within_s: float = 30.0) -> dict:
    """The model's stats from the status endpoint; a process still finishing its request
    answers the stats call late (status then gives none), so ask again for a while."""
    from expert_stream.plugin.cli.server_client import fetch_json

    deadline = time.monotonic() + within_s
    while True:
        stats = fetch_json(base + "/expert-stream/status")["models"][model].get("stats") or {}
        if stats.get("totals") or time.monotonic() > deadline:
            return stats
        time.sleep(1.0)
