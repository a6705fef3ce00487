"""What the subcommands of gpu_tool.py share: the project's CLI as a child process, the
checkpoint they run on, budgets by share of experts, the memory cap, and the output folder."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# The project's command, as a module: on the device the package is importable (setup.sh) but
# has no console script.
CLI = [sys.executable, "-m", "expert_stream.plugin.cli"]


def add_checkpoint_args(p) -> None:
    """--checkpoint, or what to synthesize one from (a trace's shape, or an architecture)."""
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="an existing MLX checkpoint folder (default: synthesize one, see --synth-out)")
    p.add_argument("--trace", type=Path, default=None, metavar="TRACE.npz",
                   help="routing trace to replay (expert-stream bench --routing); without --checkpoint the "
                   "checkpoint is made shaped like it (expert-stream synth --like-trace)")
    p.add_argument("--synth-out", type=Path, default=None,
                   help="where to make (or reuse) the synthetic checkpoint (default: /tmp/gpu-tool-<name>)")
    p.add_argument("--synth", default="", metavar="'FLAGS'",
                   help="extra expert-stream synth flags in one string, e.g. \"--hidden 2048 --bits 4\" "
                   "(without --trace: give --arch and sizes here)")
    p.add_argument("--copy-to", type=Path, default=None, metavar="DIR",
                   help="copy the checkpoint into DIR/<name> first and run on the copy (e.g. /dev/shm: a RAM-backed "
                   "filesystem standing in for a fast SSD); this tool writes it, outside any memory cap")


def add_cap_args(p, what: str = "the streamed process") -> None:
    """--cap-gib (one cap for every run), --cap-extra (budget + GiB), --require-cap."""
    p.add_argument("--cap-gib", type=float, default=None, metavar="GIB",
                   help=f"cap {what} at this many GiB, page cache included, whatever its budget (overrides --cap-extra)")
    p.add_argument("--cap-extra", default="4", metavar="GIB|none",
                   help=f"without --cap-gib: cap {what} at budget + this many GiB (default 4); applied where "
                   "cgroup v2 can cap (Linux, root), else the run is uncapped and its row says why")
    p.add_argument("--require-cap", action="store_true",
                   help="refuse to run where the cap cannot be applied (instead of running uncapped)")


def run_logged(argv: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
    """Run argv, its stderr into log_path; (returncode, stdout). A timeout is rc 124."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as err:
        err.write("$ " + shlex.join(argv) + "\n")
        err.flush()
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                               env={**os.environ, **(env or {})}, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return 124, exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return p.returncode, p.stdout


def checkpoint(args, out: Path) -> Path:
    """The checkpoint the run uses: --checkpoint, or one `expert-stream synth` makes (reused
    when the folder already holds the same one)."""
    if args.checkpoint is not None:
        if not (args.checkpoint / "config.json").is_file():
            sys.exit(f"--checkpoint {args.checkpoint}: no config.json there; give an MLX checkpoint folder")
        return args.checkpoint
    name = args.trace.stem if args.trace is not None else "synth"
    ck = args.synth_out or Path(f"/tmp/gpu-tool-{name}")
    argv = [*CLI, "synth", "--out", str(ck), *shlex.split(args.synth)]
    if args.trace is not None:
        argv += ["--like-trace", str(args.trace)]
    rc, _ = run_logged(argv, out / "synth.log")
    if rc != 0:
        sys.exit(f"expert-stream synth failed (rc {rc}); see {out / 'synth.log'}")
    return ck


def checkpoint_here(args, out: Path) -> Path:
    """checkpoint(), copied to --copy-to when given (a copy of the same files is reused)."""
    ck = checkpoint(args, out)
    if getattr(args, "copy_to", None) is None:
        return ck
    return copy_checkpoint(ck, args.copy_to / ck.name)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copy every file of the checkpoint folder `src` to `dst` (skipping files already there with
    the same size), then drop the source's pages: the runs must read the copy, not the original."""
    from expert_stream.streaming.lab.page_cache import drop_checkpoint

    if src.resolve() == dst.resolve():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        target = dst / f.name
        if not (target.is_file() and target.stat().st_size == f.stat().st_size):
            shutil.copyfile(f, target)
    drop_checkpoint(sorted(src.glob("*.safetensors")))
    return dst


def budget_for_share(ck: Path, share: float) -> tuple[float, int]:
    """(budget GiB, slots per layer) that pays for `share` of each layer's experts, at least top-k."""
    from expert_stream.streaming.footprint import checkpoint_footprint

    fp = checkpoint_footprint(ck)
    slots = min(max(fp.top_k or 1, round(share * max(fp.num_experts))), max(fp.num_experts))
    # Half a slot row over the exact figure: the budget's division into slots must not round down.
    return round(fp.budget_gib_for_slots(slots + 0.5), 6), slots


def cap_for(budget_gib: float | None, args) -> tuple[float | None, str]:
    """(cap GiB or None, why): --cap-gib, or budget + --cap-extra GiB, where cgroup v2 can cap
    this process's children; else none and the reason (an exit under --require-cap)."""
    from expert_stream.streaming.lab.memory_cap import unavailable_reason

    fixed = getattr(args, "cap_gib", None)
    if fixed is None and args.cap_extra == "none":
        return _uncapped(args, "no cap (--cap-extra none)")
    if fixed is None and budget_gib is None:
        return _uncapped(args, "no cap: an auto budget has no size to add --cap-extra to; give --cap-gib")
    reason = unavailable_reason()
    if reason is not None:
        return _uncapped(args, f"no cap: {reason}")
    cap = fixed if fixed is not None else round(budget_gib + float(args.cap_extra), 1)
    return cap, f"cgroup v2 memory.max {cap} GiB" + (" (--cap-gib, every run)" if fixed is not None else "")


def _uncapped(args, why: str) -> tuple[None, str]:
    if getattr(args, "require_cap", False):
        sys.exit(f"--require-cap: {why}")
    return None, why


def parse_pairs(text: str, where: str) -> dict[str, str]:
    """'K=V,K=V' -> {K: V}."""
    out = {}
    for pair in filter(None, text.split(",")):
        if "=" not in pair:
            sys.exit(f"{where}: {pair!r} is not KEY=VALUE")
        k, v = pair.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[fmt(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in cells) + "\n"


def write_outputs(out: Path, name: str, doc: dict, text: str, echo: bool = True) -> None:
    """OUT/NAME.json (everything) and OUT/NAME.txt (the table), the table on stdout too (echo)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / f"{name}.txt").write_text(text)
    if echo:
        print(text, end="")
