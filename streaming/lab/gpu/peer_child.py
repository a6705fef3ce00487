"""One peer in a fresh process, for `gpu_tool.py peers`: load it at the slots the budget pays
for, install the routing replay on it where its expert modules take `(x, indices)` as mlx-lm's
do, and run the benchmark's own generation loop (streaming/lab/bench.py). Usage (by tool_peers.py):
`python peer_child.py CONFIG_JSON`; the result goes to the config's result_path as JSON.

The peers' own code is used as published (bigrig 0.9.1, boyle 0.2.1); what had to change for
them to run on Linux is done here, and said in the row's notes."""

from __future__ import annotations

import dataclasses
import glob
import json
import mmap
import os
import sys
import threading
import time
import traceback
from pathlib import Path


def _importable(module: str, wheels_dir: str) -> str:
    """Import `module`, from the pure-Python wheels in wheels_dir if it is not installed."""
    try:
        __import__(module)
        return "installed"
    except ImportError:
        sys.path[:0] = sorted(glob.glob(os.path.join(wheels_dir, "*.whl")))
        __import__(module)
        return f"wheel zip from {wheels_dir}"


def _boyle_linux_reads(mode: str, notes: list) -> bool:
    """boyle reads misses with pread on F_NOCACHE descriptors, and fcntl.F_NOCACHE is macOS only:
    on Linux its first miss raises. Give CheckpointExpertStore.read_raw the same reads with
    Linux's bypass ('direct': O_DIRECT of the covering aligned range; 'fadvise': pread then
    POSIX_FADV_DONTNEED; 'cached': plain pread). Returns boyle's `direct` argument."""
    import fcntl

    import numpy as np
    from boyle import _runtime as br

    if mode == "mmap":
        return False  # boyle's own direct=False path
    if mode == "native":
        if not hasattr(fcntl, "F_NOCACHE"):
            notes.append("boyle-io native: no fcntl.F_NOCACHE here, boyle fails on its first miss")
        return True
    fds, lock, state = {}, threading.Lock(), {"mode": mode}

    def fd(path, flags):
        with lock:
            if (path, flags) not in fds:
                fds[path, flags] = os.open(path, flags)
            return fds[path, flags]

    def read_raw(self, name, start_elem, n_elems, out_shape):
        shard, dtype, _, offset = self._specs[name]
        np_dtype, _ = br._DTYPES[dtype]
        size = np.dtype(np_dtype).itemsize
        start, n = offset + start_elem * size, n_elems * size
        raw = None
        if state["mode"] == "direct":
            a0, a1 = start - start % 4096, -(-(start + n) // 4096) * 4096
            buf = mmap.mmap(-1, a1 - a0)  # page-aligned, as O_DIRECT needs
            try:
                if os.preadv(fd(shard, os.O_RDONLY | os.O_DIRECT), [buf], a0) < start + n - a0:
                    raise OSError("short O_DIRECT read")
                raw = np.frombuffer(buf, dtype=np.uint8)[start - a0:start - a0 + n].copy()
            except OSError as exc:
                state["mode"] = "fadvise"
                notes.append(f"boyle-io direct refused here ({exc}): fadvise instead")
            finally:
                buf.close()
        if raw is None:
            f = fd(shard, os.O_RDONLY)
            raw = np.frombuffer(os.pread(f, n, start), dtype=np.uint8)
            if state["mode"] == "fadvise":
                os.posix_fadvise(f, start - start % 4096, n + start % 4096, os.POSIX_FADV_DONTNEED)
        return raw.view(np_dtype).reshape(out_shape), dtype

    br.CheckpointExpertStore.read_raw = read_raw
    notes.append(f"boyle reads: {mode} (Linux stand-in for its F_NOCACHE pread)")
    return True


def load_boyle(cfg, rep):
    rep["import"] = _importable("boyle", cfg["wheels_dir"])
    import boyle
    import mlx.core as mx
    from boyle import _runtime as br
    from boyle.budget import MIN_CAPACITY
    from boyle.loader import read_anatomy
    from mlx_lm.utils import load_model

    rep["peer_version"] = boyle.__version__
    layers = read_anatomy(cfg["model_dir"]).layers
    caps = [max(MIN_CAPACITY, min(n, cfg["slots"])) for n, _ in layers]
    if any(c > min(n, cfg["slots"]) for c, (n, _) in zip(caps, layers)):
        rep["notes"].append(f"boyle keeps at least {MIN_CAPACITY} slots per layer: {caps[0]} instead of {cfg['slots']}")
    direct = _boyle_linux_reads(cfg["boyle_io"], rep["notes"])
    model, _ = load_model(Path(cfg["model_dir"]), lazy=True)
    wrapped = br.apply_expert_offload(model, cfg["model_dir"], capacity_plan=caps,
                                      io_workers=cfg["boyle_io_workers"], direct=direct)
    mx.eval(model.parameters())
    rep["mapping"] = {"capacity_per_layer": caps[0], "wrapped_layers": wrapped}
    return model, (lambda: br.offload_stats(model)), (br.OffloadSwitchGLU,)


def _bigrig_nocache_linux(notes):
    """bigrig's nocache sets F_NOCACHE (48) and ignores the EINVAL Linux answers: a silent no-op
    there. Drop each range read from the page cache after the read instead."""
    from bigrig_engine import fetch

    orig = fetch.ParallelFetcher._read_region

    def read_region(self, key):
        out = orig(self, key)
        for seg in self.store.segments(key):
            f = os.open(seg.path, os.O_RDONLY)
            try:
                os.posix_fadvise(f, seg.offset, seg.length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(f)
        return out

    fetch.ParallelFetcher._read_region = read_region
    notes.append("bigrig nocache: F_NOCACHE emulated with POSIX_FADV_DONTNEED after each read")


def load_bigrig(cfg, rep):
    rep["import"] = _importable("bigrig_engine", cfg["wheels_dir"])  # sets MLX_MAX_OPS_PER_BUFFER=8
    from importlib.metadata import PackageNotFoundError, version

    from bigrig_engine import autoconfig, stream

    try:
        rep["peer_version"] = version("bigrig")
    except PackageNotFoundError:
        rep["peer_version"] = "0.9.1 (wheel zip)"
    E, k, L, C = cfg["n_experts"], cfg["top_k"], cfg["moe_layers"], min(cfg["slots"], cfg["n_experts"])
    if C < k:
        rep["notes"].append(f"{C} slots per layer < top-k {k}: bigrig refuses this")
    nocache = cfg["bigrig_io"] == "nocache"
    if nocache and sys.platform != "darwin":
        _bigrig_nocache_linux(rep["notes"])
    if cfg["bigrig_io"] == "read":
        os.environ["BIGRIG_MMAP"] = "0"
    full, cap = (), C
    if cfg["bigrig_full_layers"] == "auto":  # what bigrig's Session does without a calibration
        n_full, rest = autoconfig.plan_full_layers(L, E, k, C)
        if n_full:
            full, cap = tuple(range(n_full)), rest
    elif cfg["bigrig_full_layers"] != "off":
        n_full = int(cfg["bigrig_full_layers"])
        full = tuple(range(n_full))
        cap = max(k, (C * L - E * n_full) // max(1, L - n_full)) if n_full < L else E
    manifest, blob = stream.expert_source(cfg["model_dir"])  # the model's own shards, no packed copy
    model, _, handle = stream.load_streaming(cfg["model_dir"], blob, capacity=cap, manifest=manifest,
                                             threads=cfg["bigrig_threads"], nocache=nocache,
                                             full_layers=full, warm="auto")
    rep["mapping"] = {"full_layers": len(full), "streamed_capacity": cap, "io": cfg["bigrig_io"]}
    rep["_close"] = handle
    keep = ("hits", "misses", "fetch_seconds", "fetch_gb")
    return model, (lambda: {key: handle.stats().get(key) for key in keep}), (stream.StreamingSwitchGLU,)


def load_mlxlm(cfg, rep):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(cfg["model_dir"]))
    mx.eval(model.parameters())
    rep["mapping"] = {"every expert resident": True}
    return model, (lambda: {}), ()


LOADERS = {"boyle": load_boyle, "bigrig": load_bigrig, "mlxlm": load_mlxlm}


def install_replay(cfg, model, peer_classes, rep):
    """The benchmark's replay on the peer's model, its expert modules counted as expert calls;
    None (and why, in the row) where it cannot cover every MoE layer."""
    from expert_stream.streaming.architectures import GENERIC
    from expert_stream.streaming.lab.replay import ReplayError, install
    from expert_stream.streaming.traces import load_trace

    spec = dataclasses.replace(GENERIC, name="peer", model_types=(cfg["model_type"],),
                               expert_classes=(*GENERIC.expert_classes, *peer_classes))
    try:
        replay = install(model, load_trace(cfg["trace"]), cfg["model_type"], cfg["n_experts"], cfg["top_k"],
                         where=cfg["model_dir"], architectures=[spec])
    except ReplayError as exc:
        rep["routing"] = f"cannot replay the trace: {exc}"
        return None
    if len(replay.paths) != cfg["moe_layers"]:
        rep["routing"] = (f"cannot replay the trace: found {len(replay.paths)} expert calls for "
                          f"{cfg['moe_layers']} MoE layers")
        return None
    rep["routing"] = "replayed trace"
    return replay


def _delta(end: dict, start: dict) -> dict:
    return {k: end[k] - (start.get(k) or 0) for k in end
            if isinstance(end[k], (int, float)) and not isinstance(end[k], bool)}


def main(cfg: dict) -> None:
    log = os.open(cfg["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)  # the peer's own output, MLX's and Python's, all to the row's log
    os.dup2(log, 2)
    rep = {"peer": cfg["peer"], "ok": False, "notes": [], "error": None, "routing": "own (random router)"}
    try:
        for kv in cfg["env"]:
            key, _, value = kv.partition("=")
            os.environ[key] = value
        if cfg["peer"] == "bigrig":
            os.environ.setdefault("BIGRIG_HOME", cfg["bigrig_home"])
            if cfg["prefetch"] != "default":
                os.environ["BIGRIG_STAGE"] = "1" if cfg["prefetch"] == "on" else "0"
        t0 = time.perf_counter()
        model, stats, peer_classes = LOADERS[cfg["peer"]](cfg, rep)
        rep["load_s"] = time.perf_counter() - t0
        replay = install_replay(cfg, model, peer_classes, rep) if cfg["trace"] else None
        if cfg["trace"] and replay is None and not cfg["own_routing"]:
            raise RuntimeError(rep["routing"] + " (--own-routing runs it on its own routing)")

        import mlx.core as mx
        import numpy as np

        from expert_stream.streaming.lab.bench import timed_generation
        from expert_stream.streaming.lab.page_cache import drop_checkpoint

        prompt = mx.array(np.random.default_rng(0).integers(3, cfg["vocab_size"] - 1, cfg["prompt_tokens"]), dtype=mx.int32)
        marks = {}
        run = timed_generation(model, prompt, cfg["gen_tokens"], cfg["prefill_step"],
                               on_start=lambda: (drop_checkpoint(sorted(Path(cfg["model_dir"]).glob("*.safetensors"))),
                                                 marks.update(start=dict(stats()))),
                               on_first=lambda: marks.update(first=dict(stats())),
                               replay=replay, start_row=cfg["trace_start"])
        decode = _delta(stats(), marks["first"])
        steps = max(len(run["tokens"]) - 1, 1)
        if "misses" in decode:
            decode["misses_per_token"] = decode["misses"] / steps
        rep.update(ok=True, run={k: v for k, v in run.items() if k != "tokens"}, tokens=run["tokens"],
                   stats_decode=decode, device=str(mx.default_device()))
        import resource

        rep["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    except BaseException as exc:  # noqa: BLE001 -- the row reports it; the next peer runs
        rep["error"] = f"{type(exc).__name__}: {exc}"
        rep["traceback"] = traceback.format_exc()[-3000:]
    handle = rep.pop("_close", None)
    Path(cfg["result_path"]).write_text(json.dumps(rep, default=str))
    if handle is not None and hasattr(handle, "close"):
        handle.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the peers' reader threads need no orderly teardown: the result is written


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
