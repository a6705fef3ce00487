#!/usr/bin/env python3
"""Benchmark published MoE expert-streaming peers (bigrig 0.9.1, boyle 0.2.1) on a local
mlx-community-layout checkpoint at the same expert budget as expert_stream's bench.

    python peers_bench.py MODEL_DIR --budget-gib B --prompt-tokens P --gen-tokens G \
        [--peers bigrig,boyle] [--json]

Budget meaning (ours): B GiB = bytes of expert cache across all MoE layers. Mapped exactly as
expert_stream.streaming.budget.plan_layers does it: slots = floor(B*2^30 / sum over MoE layers of
one expert's bytes), the same number of slots in every layer, capped at the expert count.
  bigrig: capacity=slots experts per layer (its `--residency` = slots/E). bigrig refuses
          slots < top_k. By default (--bigrig-full-layers auto, what bigrig's Session does
          without a calibration) the same slot total is re-split into whole layers + the rest.
  boyle:  capacity_plan=[slots]*L experts per layer (its `--budget` also counts non-expert
          weights, KV at --max-context and a 4 GB headroom; the equivalent value is printed).
          boyle floors every layer at 8 slots (MIN_CAPACITY): reported as floor_applied.
  mlxlm:  optional reference, stock mlx-lm with every expert resident (no budget).

Each peer runs in a fresh subprocess (own memory, own MLX caches); a peer that crashes or
times out is reported with its error text and the next one runs. Prompt: P random token ids,
numpy default_rng(0).integers(3, vocab-1, P) -- the same prompt expert_stream's bench uses --
fed as ids through mlx_lm.generate.generate_step (greedy), the same loop for every peer.
prefill_s = time to the first token; decode tok/s = (G-1) / (t_last - t_first).

Only needs what mlx-lm needs (numpy, huggingface_hub, transformers, tokenizers, safetensors,
psutil optional) plus the two pure-Python peer wheels. If the peers are not installed, the
wheels in ./wheels next to this script (or --wheels-dir) are put on sys.path directly
(pure-Python wheels import fine from the zip; no pip needed).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
# This folder is sys.path[0] when run as a script, and other files in it (e.g. a profile.py)
# shadow stdlib modules (torch/transformers import cProfile -> profile). Drop it.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

GIB = 1 << 30
MARK = "@@PEERS_BENCH_RESULT@@ "
ALL_PEERS = ("bigrig", "bigrig-session", "boyle", "mlxlm")


# --------------------------------------------------------------------------- checkpoint anatomy
def _st_headers(model_dir):
    out = {}
    for shard in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            hdr = json.loads(f.read(n))
        for name, spec in hdr.items():
            if name != "__metadata__":
                a, b = spec["data_offsets"]
                out[name] = (tuple(spec["shape"]), spec["dtype"], b - a, shard)
    return out


def _text_config(cfg):
    return {**cfg, **(cfg.get("text_config") or {})}


def anatomy(model_dir):
    """Expert bytes per MoE layer from the shard headers: tensors under `switch_mlp` (or a stacked
    `.experts.` tensor) whose first dim is the expert count."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = _text_config(json.load(f))
    E = next((int(cfg[k]) for k in ("num_experts", "n_routed_experts", "num_local_experts",
                                     "moe_num_experts") if cfg.get(k)), None)
    top_k = next((int(cfg[k]) for k in ("num_experts_per_tok", "top_k", "moe_top_k",
                                         "num_experts_per_token") if cfg.get(k)), None)
    hdr = _st_headers(model_dir)
    layer_bytes, layer_E = {}, {}
    for name, (shape, dtype, nbytes, _) in hdr.items():
        if not shape or ("switch_mlp" not in name and not re.search(r"\.experts\.[a-z]", name)):
            continue
        if E is not None and shape[0] != E:
            continue
        m = re.search(r"layers\.(\d+)\.", name)
        if not m:
            continue
        li = int(m.group(1))
        layer_bytes[li] = layer_bytes.get(li, 0) + nbytes
        layer_E[li] = shape[0]
    layers = sorted(layer_bytes)
    total = sum(v[2] for v in hdr.values())
    per_expert = [layer_bytes[l] // layer_E[l] for l in layers]
    return {
        "model_type": cfg.get("model_type"),
        "vocab_size": int(cfg.get("vocab_size") or 0),
        "n_experts": E or (layer_E[layers[0]] if layers else None),
        "top_k": top_k,
        "moe_layers": len(layers),
        "expert_bytes": sum(layer_bytes.values()),
        "trunk_bytes": total - sum(layer_bytes.values()),
        "total_bytes": total,
        "bytes_per_expert": per_expert[0] if per_expert else 0,
        "slot_row_bytes": sum(per_expert),          # one slot in every MoE layer
        "dtypes": sorted({v[1] for v in hdr.values()}),
        "shards": sorted({v[3] for v in hdr.values()}),
    }


# --------------------------------------------------------------------------- page cache helpers
def evict_page_cache(paths):
    """Drop the shards' clean pages (posix_fadvise DONTNEED; no root needed)."""
    if not hasattr(os, "posix_fadvise"):
        return "posix_fadvise unavailable"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "ok"


def page_cache_fraction(paths):
    """Fraction of the shards' pages resident in the page cache (mincore), or None."""
    try:
        import ctypes
        import mmap
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = os.sysconf("SC_PAGESIZE")
        res = tot = 0
        for p in paths:
            size = os.path.getsize(p)
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                rc = libc.mincore(addr, size, vec)
                libc.munmap(addr, size)
                if rc != 0:
                    return None
                res += sum(b & 1 for b in bytes(vec))
                tot += n
            finally:
                os.close(fd)
        return round(res / tot, 4) if tot else None
    except Exception:  # noqa: BLE001 -- a reading, never a failure
        return None


# --------------------------------------------------------------------------- child side
def _ensure_importable(mod, wheels_dir):
    try:
        __import__(mod)
        return "installed"
    except ImportError:
        pass
    for w in sorted(glob.glob(os.path.join(wheels_dir, "*.whl"))):
        if w not in sys.path:
            sys.path.insert(0, w)
    __import__(mod)
    return "wheel-zip:" + wheels_dir


def _peak_rss():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _timed_generation(model, prompt, gen_tokens, prefill_step, stats_fn):
    """Same loop and definitions as expert_stream.streaming.bench.timed_generation."""
    from mlx_lm.generate import generate_step
    toks, stamps = [], []
    snap = {}
    kw = {"max_tokens": gen_tokens}
    if prefill_step:
        kw["prefill_step_size"] = prefill_step
    t0 = time.perf_counter()
    for tok, _ in generate_step(prompt, model, **kw):
        toks.append(int(tok))
        stamps.append(time.perf_counter())
        if len(toks) == 1:
            snap = stats_fn() or {}
    t_first = stamps[0]
    dec = max(stamps[-1] - t_first, 1e-9)
    steady = stamps[len(stamps) // 3:]          # boyle bench's own definition, for reference
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {
        "tokens": toks,
        "prefill_s": t_first - t0,
        "prefill_tok_s": prompt.size / (t_first - t0),
        "decode_s": dec,
        "decode_tok_s": (len(toks) - 1) / dec if len(toks) > 1 else 0.0,
        "decode_tok_s_steady": ((len(steady) - 1) / (steady[-1] - steady[0])
                                if len(steady) > 2 else None),
        "median_token_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
    }, snap


GAUGES = {"layers", "resident_gb", "sync_free", "full_layers", "capacity"}


def _delta(end, start, keys):
    out = {}
    for k in keys:
        if k in GAUGES:
            continue
        if isinstance(end.get(k), (int, float)) and not isinstance(end.get(k), bool):
            out[k] = end[k] - (start.get(k) or 0)
    h, m = out.get("hits"), out.get("misses")
    if h is not None and m is not None:
        out["hit_rate"] = h / (h + m) if (h + m) else None
    return out


# ---- boyle
def _boyle_patch_io(mode, rep):
    """boyle reads misses with pread on F_NOCACHE fds: fcntl.F_NOCACHE is macOS-only, so on Linux
    its first miss raises AttributeError. Replace CheckpointExpertStore.read_raw with the same
    code and a Linux page-cache bypass: 'direct' = O_DIRECT read of the page-aligned covering
    range (falls back to 'fadvise' if refused), 'fadvise' = pread + POSIX_FADV_DONTNEED of the
    range, 'cached' = plain pread. 'mmap' uses boyle's own direct=False path (memmap copy)."""
    import fcntl
    import mmap
    import numpy as np
    from boyle import _runtime as br
    if mode == "mmap":
        return False
    if mode == "native":
        if not hasattr(fcntl, "F_NOCACHE"):
            rep["notes"].append("boyle-io native: fcntl.F_NOCACHE missing here, boyle will crash "
                                "on its first expert miss (expected on Linux)")
        return True
    page = os.sysconf("SC_PAGESIZE")
    align = 4096
    state = {"mode": mode, "refused": None}
    fds = {}  # (shard, open flags) -> fd, shared by the reader threads
    lock = threading.Lock()

    def _fd(shard, flags=os.O_RDONLY):
        fd = fds.get((shard, flags))
        if fd is None:
            with lock:
                fd = fds.get((shard, flags))
                if fd is None:
                    fd = fds[(shard, flags)] = os.open(shard, flags)
        return fd

    def read_raw(self, name, start_elem, n_elems, out_shape):
        shard, dtype, _, offset = self._specs[name]
        np_dtype, _ = br._DTYPES[dtype]
        itemsize = np.dtype(np_dtype).itemsize
        start = offset + start_elem * itemsize
        n_bytes = n_elems * itemsize
        raw = None
        if state["mode"] == "direct":
            a0 = start - start % align
            a1 = -(-(start + n_bytes) // align) * align
            buf = mmap.mmap(-1, a1 - a0)                      # page-aligned anonymous buffer
            try:
                got = os.preadv(_fd(shard, os.O_RDONLY | os.O_DIRECT), [buf], a0)
                if got < start + n_bytes - a0:
                    raise OSError("short O_DIRECT read")
                raw = np.frombuffer(buf, dtype=np.uint8)[start - a0:start - a0 + n_bytes].copy()
            except OSError as e:
                state["mode"] = "fadvise"
                state["refused"] = f"O_DIRECT refused ({e}); fadvise instead"
            finally:
                buf.close()
        if raw is None:
            fd = _fd(shard)
            raw = np.frombuffer(os.pread(fd, n_bytes, start), dtype=np.uint8)
            if state["mode"] == "fadvise":
                os.posix_fadvise(fd, start - start % page, n_bytes + start % page,
                                 os.POSIX_FADV_DONTNEED)
        return raw.view(np_dtype).reshape(out_shape), dtype

    br.CheckpointExpertStore.read_raw = read_raw
    rep["_io_state"] = state
    return True


def run_boyle(cfg, rep):
    src = _ensure_importable("boyle", cfg["wheels_dir"])
    import mlx.core as mx
    from pathlib import Path
    import boyle
    from boyle import _runtime as br
    from boyle.budget import MIN_CAPACITY, fmt_size, plan as boyle_plan
    from boyle.loader import read_anatomy
    from mlx_lm.utils import load_model
    rep["peer_version"] = boyle.__version__
    rep["import"] = src
    md = cfg["model_dir"]
    slots = cfg["slots"]
    an = read_anatomy(md)
    caps = [max(MIN_CAPACITY, min(n, slots)) for n, _ in an.layers]
    eff = an.slots_bytes(tuple(caps))
    max_ctx = cfg["prompt_tokens"] + cfg["gen_tokens"]
    headroom = 4 * 10**9
    equiv = an.resident_bytes + eff + an.kv_bytes_per_token * max_ctx + headroom
    try:
        chk = boyle_plan(an, equiv, max_context=max_ctx, headroom=headroom).capacities
    except Exception as e:  # noqa: BLE001
        chk = f"plan refused: {e}"
    rep["mapping"] = {
        "knob": "apply_expert_offload(capacity_plan=[slots]*layers) (what boyle.load does after "
                "resolving --budget)",
        "capacity_per_layer": caps, "floor_applied": any(c > min(n, slots) for c, (n, _) in
                                                         zip(caps, an.layers)),
        "expert_cache_bytes": eff,
        "equivalent_boyle_budget": f"--budget {equiv} (= {fmt_size(equiv)}) --max-context "
                                   f"{max_ctx} --headroom 4GB -> capacities {chk}",
        "io_workers": cfg["boyle_io_workers"], "io": cfg["boyle_io"],
    }
    use_pread = _boyle_patch_io(cfg["boyle_io"], rep)
    t0 = time.perf_counter()
    model, _ = load_model(Path(md), lazy=True)
    wrapped = br.apply_expert_offload(model, md, capacity_plan=caps,
                                      io_workers=cfg["boyle_io_workers"], direct=use_pread)
    mx.eval(model.parameters())
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if "max_recommended_working_set_size" in info:   # boyle.load's last step (Metal only)
        mx.set_wired_limit(min(equiv, int(info["max_recommended_working_set_size"])))
    rep["load_s"] = time.perf_counter() - t0
    rep["mapping"]["wrapped_layers"] = wrapped
    if wrapped != len(an.layers):
        rep["notes"].append(f"boyle wrapped {wrapped} of {len(an.layers)} MoE layers "
                            f"(unwrapped layers run fully resident)")
    stats = lambda: br.offload_stats(model)  # noqa: E731
    return model, stats, None


# ---- bigrig
def _bigrig_linux_shims(rep):
    """bigrig's Session/autoconfig read memory via macOS `vm_stat`/`sysctl`; give them psutil."""
    from bigrig_engine import calibrate as cal
    try:
        import psutil
        cal.available_gb = lambda: psutil.virtual_memory().available / 1e9
        cal.total_gb = lambda: psutil.virtual_memory().total / 1e9
    except ImportError:
        cal.available_gb = lambda: os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGESIZE") / 1e9
        cal.total_gb = lambda: os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE") / 1e9
    cal._vm = lambda key: 0
    rep["notes"].append("bigrig-session: macOS vm_stat/sysctl memory probes replaced by psutil")


def _bigrig_nocache_linux(rep):
    """bigrig's nocache uses fcntl(fd, 48=F_NOCACHE) and swallows the EINVAL on Linux, i.e. it is a
    silent no-op there. Emulate: drop each read range from the page cache after reading."""
    from bigrig_engine import fetch
    if sys.platform == "darwin" or not hasattr(os, "posix_fadvise"):
        return
    orig = fetch.ParallelFetcher._read_region

    def _read_region(self, key):
        out = orig(self, key)
        if self.nocache:
            for seg in self.store.segments(key):
                fd = os.open(seg.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, seg.offset, seg.length, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return out
    fetch.ParallelFetcher._read_region = _read_region
    rep["notes"].append("bigrig nocache: F_NOCACHE emulated with POSIX_FADV_DONTNEED after reads")


def run_bigrig(cfg, rep, session=False):
    src = _ensure_importable("bigrig_engine", cfg["wheels_dir"])   # sets MLX_MAX_OPS_PER_BUFFER=8
    from bigrig_engine import autoconfig, stream
    rep["import"] = src
    try:
        from importlib.metadata import version
        rep["peer_version"] = version("bigrig")
    except Exception:  # noqa: BLE001
        rep["peer_version"] = "0.9.1 (wheel)"
    rep["env"] = {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith("BIGRIG_")
                  or k == "MLX_MAX_OPS_PER_BUFFER"}
    md = cfg["model_dir"]
    E, k, L = cfg["n_experts"], cfg["top_k"] or 1, cfg["moe_layers"]
    C = min(cfg["slots"], E)
    nocache = cfg["bigrig_io"] == "nocache"
    if nocache:
        _bigrig_nocache_linux(rep)
    if cfg["bigrig_io"] == "read":
        os.environ["BIGRIG_MMAP"] = "0"
    threads = cfg["bigrig_threads"]
    t0 = time.perf_counter()
    blob = ""
    if cfg.get("bigrig_pack_dir"):
        bp = os.path.join(cfg["bigrig_pack_dir"], os.path.basename(md.rstrip("/")) + ".experts")
        tp = time.perf_counter()
        blob = stream.ensure_packed(md, bp, verbose=False)
        rep["pack_s"] = time.perf_counter() - tp
        man = stream.load_manifest(blob)
    else:
        man, blob = stream.expert_source(md)      # reads the model's own shards (no packed copy)
    full, cap = (), C
    fl = cfg["bigrig_full_layers"]
    if session:
        _bigrig_linux_shims(rep)
        from bigrig_engine.session import Session
        kw = dict(capacity=C, budget_gb=cfg["bigrig_session_mem_gb"], monitor=False,
                  persist=False, remember=False, verbose=True, threads=threads, nocache=nocache)
        if fl == "off":
            kw["no_full_layers"] = True
        elif fl not in ("auto",):
            kw["full_layers"] = tuple(range(int(fl)))
        if cfg["prefetch"] == "on":
            kw["prefetch_width"] = 8
        if blob:
            rep["notes"].append("bigrig-session finds the packed blob only under BIGRIG_HOME/"
                                "data/blobs; --bigrig-pack-dir is ignored by Session")
        s = Session(md, **kw)
        model, handle = s.model, s.handle
        rep["session_prefill_step"] = getattr(s, "prefill_step", None)
        rep["session_plan_lines"] = list(getattr(s, "plan_lines", []))
        if not cfg["prefill_step_given"]:
            cfg["prefill_step"] = getattr(s, "prefill_step", None) or cfg["prefill_step"]
    else:
        if fl == "auto":
            nf, rest = autoconfig.plan_full_layers(L, E, k, C)
            if nf:
                full, cap = tuple(range(nf)), rest
        elif fl != "off":
            nf = int(fl)
            full = tuple(range(nf))
            cap = max(k, (C * L - E * nf) // max(1, L - nf)) if nf < L else E
        model, _tok, handle = stream.load_streaming(md, blob, capacity=cap, manifest=man,
                                                    threads=threads, nocache=nocache,
                                                    full_layers=full, warm="auto")
    rep["load_s"] = time.perf_counter() - t0
    st = handle.stats() if handle is not None else {}
    rep["mapping"] = {
        "knob": ("Session(capacity=slots) (bigrig's own planner then splits it)" if session else
                 "stream.load_streaming(capacity=C experts/layer, full_layers=...)"),
        "slots_per_layer_uniform": C, "residency_flag": f"--residency {C / E:.4f}",
        "full_layers": st.get("full_layers", len(full)),
        "streamed_capacity": st.get("capacity", cap),
        "pool_bytes_after_load": int(round((st.get("resident_gb") or 0) * 1e9)),
        "planned_slot_bytes": C * L * cfg["bytes_per_expert"],
        "source": ("packed blob " + blob) if blob else "model's own safetensors (direct)",
        "io": cfg["bigrig_io"], "threads": threads,
        "views_decode": stream.VIEWS_DECODE, "views_prefill": stream.VIEWS_PREFILL,
        "staging_prefetch": stream.STAGING, "zero_copy": stream.ZERO_COPY,
    }
    if C < k:
        rep["notes"].append(f"budget pays for {C} slots/layer < top_k={k}: bigrig refuses this")
    keep = ("hits", "misses", "fetch_seconds", "admit_seconds", "sync_seconds", "fetch_gb",
            "stage_issued", "stage_hits", "zero_copy_admits", "chunked_calls", "resident_gb",
            "sync_free", "full_layers", "capacity", "spec_ready", "spec_late", "spec_none")
    stats = lambda: {kk: handle.stats().get(kk) for kk in keep}  # noqa: E731
    return model, stats, handle


# ---- stock reference
def run_mlxlm(cfg, rep):
    import mlx.core as mx
    from pathlib import Path
    from mlx_lm.utils import load_model
    t0 = time.perf_counter()
    model, _ = load_model(Path(cfg["model_dir"]))
    mx.eval(model.parameters())
    rep["load_s"] = time.perf_counter() - t0
    rep["mapping"] = {"knob": "none: stock mlx-lm, every expert resident (reference)"}
    return model, (lambda: {}), None


def child_main(cfg):
    rep = {"peer": cfg["peer"], "ok": False, "notes": [], "error": None}
    try:
        for kv in cfg.get("env") or []:
            k, _, v = kv.partition("=")
            os.environ[k] = v
        if cfg["peer"].startswith("bigrig"):
            os.environ.setdefault("BIGRIG_HOME", cfg["bigrig_home"])
            if cfg["prefetch"] == "on":
                os.environ["BIGRIG_STAGE"] = "1"
            elif cfg["prefetch"] == "off":
                os.environ["BIGRIG_STAGE"] = "0"
            if cfg["bigrig_views"] != "default":
                v = "1" if cfg["bigrig_views"] == "on" else "0"
                os.environ["BIGRIG_VIEWS_DECODE"] = v
                os.environ["BIGRIG_VIEWS_PREFILL"] = v
        if cfg["peer"] == "boyle" and cfg["prefetch"] == "on":
            rep["notes"].append("boyle has no prefetch/lookahead (removed as measured-dead); "
                                "--prefetch ignored")
        if cfg["peer"] == "boyle":
            model, stats, handle = run_boyle(cfg, rep)
        elif cfg["peer"] == "bigrig":
            model, stats, handle = run_bigrig(cfg, rep, session=False)
        elif cfg["peer"] == "bigrig-session":
            model, stats, handle = run_bigrig(cfg, rep, session=True)
        elif cfg["peer"] == "mlxlm":
            model, stats, handle = run_mlxlm(cfg, rep)
        else:
            raise ValueError(f"unknown peer {cfg['peer']!r}")
        import mlx.core as mx
        import numpy as np
        rep["device"] = str(mx.default_device())
        rep["mlx_version"] = mx.__version__
        rep["env_mlx_ops_per_buffer"] = os.environ.get("MLX_MAX_OPS_PER_BUFFER")
        prompt = mx.array(np.random.default_rng(cfg["seed"]).integers(
            3, cfg["vocab_size"] - 1, cfg["prompt_tokens"]), dtype=mx.int32)
        if cfg["warmup_tokens"]:
            wp = mx.array(np.random.default_rng(cfg["seed"] + 1).integers(
                3, cfg["vocab_size"] - 1, 8), dtype=mx.int32)
            _timed_generation(model, wp, cfg["warmup_tokens"], cfg["prefill_step"], stats)
            rep["notes"].append(f"warm-up run of {cfg['warmup_tokens']} tokens before timing "
                                "(cache not reset)")
        start = stats() or {}
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        run, at_first = _timed_generation(model, prompt, cfg["gen_tokens"], cfg["prefill_step"],
                                          stats)
        end = stats() or {}
        rep["run"] = {k: v for k, v in run.items() if k != "tokens"}
        rep["prefill_step"] = cfg["prefill_step"] or "mlx_lm default (2048)"
        rep["tokens_head"] = run["tokens"][:16]
        rep["tokens"] = run["tokens"]
        rep["stats_total"] = end
        keys = sorted(set(end) | set(start))
        rep["stats_prefill"] = _delta(at_first, start, keys)
        rep["stats_decode"] = _delta(end, at_first, keys)
        dm = rep["stats_decode"].get("misses")
        if dm is not None and len(run["tokens"]) > 1:
            rep["stats_decode"]["misses_per_token"] = dm / (len(run["tokens"]) - 1)
            rep["stats_decode"]["miss_bytes_per_token"] = int(
                dm * cfg["bytes_per_expert"] / (len(run["tokens"]) - 1))
        rep["peak_rss_gb"] = _peak_rss() / 1e9
        if hasattr(mx, "get_peak_memory"):
            rep["mlx_peak_gb"] = mx.get_peak_memory() / 1e9
        io = rep.pop("_io_state", None)
        if io:
            rep["mapping"]["io_effective"] = io["mode"]
            if io["refused"]:
                rep["notes"].append(io["refused"])
        rep["ok"] = True
        if handle is not None and hasattr(handle, "close"):
            try:
                handle.close()
            except Exception:  # noqa: BLE001
                pass
    except BaseException as e:  # noqa: BLE001 -- report, never die silently
        rep["error"] = f"{type(e).__name__}: {e}"
        rep["traceback"] = traceback.format_exc()[-4000:]
        rep.pop("_io_state", None)
    sys.stdout.flush()
    print(MARK + json.dumps(rep, default=str), flush=True)
    os._exit(0)       # skip interpreter teardown (peer thread pools, MLX) -- the result is out


# --------------------------------------------------------------------------- parent side
def run_child(cfg, timeout, verbose):
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(cfg)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         bufsize=1, start_new_session=True)
    lines, result = [], None

    def pump():
        nonlocal result
        for line in p.stdout:
            if line.startswith(MARK):
                result = json.loads(line[len(MARK):])
                continue
            lines.append(line.rstrip("\n"))
            if verbose:
                print(f"  [{cfg['peer']}] {line.rstrip()}", file=sys.stderr, flush=True)
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    t0 = time.perf_counter()
    timed_out = False
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    th.join(timeout=10)
    wall = time.perf_counter() - t0
    tail = "\n".join(lines[-40:])
    if result is None:
        why = (f"timed out after {timeout}s" if timed_out else
               f"process died with exit code {p.returncode}"
               + (f" (signal {-p.returncode})" if p.returncode and p.returncode < 0 else ""))
        result = {"peer": cfg["peer"], "ok": False, "error": why, "notes": []}
    result["wall_s"] = wall
    result["log_tail"] = tail
    return result


def fmt_row(r):
    if not r.get("ok"):
        return f"{r['peer']:<15} FAILED: {r.get('error')}"
    run, sd = r["run"], r.get("stats_decode", {})
    hr = sd.get("hit_rate")
    return (f"{r['peer']:<15} decode {run['decode_tok_s']:8.2f} tok/s (steady "
            f"{(run.get('decode_tok_s_steady') or 0):7.2f})  prefill {run['prefill_s']:7.3f} s "
            f"({run['prefill_tok_s']:8.1f} tok/s)  load {r.get('load_s', 0):6.2f} s  "
            f"decode hit {('%.3f' % hr) if hr is not None else '  n/a'}  "
            f"miss/tok {sd.get('misses_per_token', float('nan')):.2f}  "
            f"rss {r.get('peak_rss_gb', 0):.2f} GB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--budget-gib", type=float, required=True,
                    help="expert cache budget across all MoE layers, GiB (our meaning)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--peers", default="bigrig,boyle",
                    help=f"comma list from {','.join(ALL_PEERS)} (default bigrig,boyle)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-step", type=int, default=2048,
                    help="prefill_step_size for generate_step, same for all peers (2048 = "
                         "mlx_lm's and expert_stream's default); 0 = each peer's own "
                         "(bigrig-session picks its own, ~128-512)")
    ap.add_argument("--prefetch", choices=("default", "on", "off"), default="default",
                    help="peer lookahead: bigrig's next-layer-router staging (BIGRIG_STAGE; off "
                         "by default in bigrig 0.9.1); boyle has none")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per peer")
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="untimed warm-up generation first (JIT); default 0 like our bench")
    ap.add_argument("--no-evict", action="store_true",
                    help="do not drop the shards from the page cache before each peer")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                    help="extra environment for every peer child (e.g. BIGRIG_ZERO_COPY=0)")
    ap.add_argument("--wheels-dir", default=os.path.join(HERE, "wheels"))
    ap.add_argument("--bigrig-full-layers", default="auto",
                    help="auto (bigrig Session's default planner: same slot total, some layers "
                         "held whole = sync-free), off (uniform, like ours), or N")
    ap.add_argument("--bigrig-io", choices=("mapped", "read", "nocache"), default="mapped",
                    help="mapped = bigrig default (mmap page-cache views); read = BIGRIG_MMAP=0; "
                         "nocache = its F_NOCACHE path (emulated with fadvise on Linux)")
    ap.add_argument("--bigrig-views", choices=("default", "on", "off"), default="default",
                    help="off = --slot-pool (copy experts into a C-slot tensor)")
    ap.add_argument("--bigrig-threads", type=int, default=8)
    ap.add_argument("--bigrig-pack-dir", default="",
                    help="pack an expert-contiguous copy here first (bigrig CLI default; costs "
                         "expert_bytes of disk); default: read the model's own shards")
    ap.add_argument("--bigrig-session-mem-gb", type=float, default=0.0,
                    help="memory ceiling given to bigrig Session (default: 90%% of RAM)")
    ap.add_argument("--boyle-io", choices=("direct", "fadvise", "cached", "mmap", "native"),
                    default="direct",
                    help="direct = O_DIRECT reads (page-cache bypass, what boyle's F_NOCACHE "
                         "does on macOS; default); fadvise; cached = plain pread; mmap = "
                         "boyle's direct=False; native = unpatched (crashes on Linux)")
    ap.add_argument("--boyle-io-workers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1,
                    help="fresh-process runs per peer (summary gives the median decode tok/s)")
    ap.add_argument("-q", "--quiet", action="store_true", help="do not echo peer logs")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args()

    an = anatomy(a.model_dir)
    if not an["moe_layers"]:
        sys.exit(f"{a.model_dir}: no stacked expert tensors (switch_mlp) found")
    budget = int(a.budget_gib * GIB)
    slots = budget // an["slot_row_bytes"]
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    bad = [p for p in peers if p not in ALL_PEERS]
    if bad:
        sys.exit(f"unknown peer(s) {bad}; choose from {ALL_PEERS}")
    mem_gb = a.bigrig_session_mem_gb
    if not mem_gb:
        try:
            import psutil
            mem_gb = 0.9 * psutil.virtual_memory().total / 1e9
        except ImportError:
            mem_gb = 0.9 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE") / 1e9
    home = tempfile.mkdtemp(prefix="peers_bench_bigrig_home_")
    base = {
        "model_dir": os.path.abspath(a.model_dir), "budget_bytes": budget, "slots": int(slots),
        "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "seed": a.seed,
        "prefill_step": a.prefill_step, "prefill_step_given": a.prefill_step != 0,
        "prefetch": a.prefetch, "warmup_tokens": a.warmup_tokens, "env": a.env,
        "wheels_dir": a.wheels_dir, "bigrig_home": home,
        "bigrig_full_layers": a.bigrig_full_layers, "bigrig_io": a.bigrig_io,
        "bigrig_views": a.bigrig_views, "bigrig_threads": a.bigrig_threads,
        "bigrig_pack_dir": a.bigrig_pack_dir, "bigrig_session_mem_gb": mem_gb,
        "boyle_io": a.boyle_io, "boyle_io_workers": a.boyle_io_workers,
        **{k: an[k] for k in ("vocab_size", "n_experts", "top_k", "moe_layers",
                               "bytes_per_expert")},
    }
    E = an["n_experts"]
    header = {
        "model_dir": base["model_dir"], "model_type": an["model_type"], "dtypes": an["dtypes"],
        "moe_layers": an["moe_layers"], "n_experts": E, "top_k": an["top_k"],
        "expert_bytes": an["expert_bytes"], "trunk_bytes": an["trunk_bytes"],
        "bytes_per_expert": an["bytes_per_expert"], "budget_gib": a.budget_gib,
        "budget_bytes": budget, "slots_per_layer": int(min(slots, E)),
        "budget_covers_all_experts": slots >= E, "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens, "prefill_step": a.prefill_step, "prefetch": a.prefetch,
        "python": sys.version.split()[0],
    }
    log = (lambda m: None) if a.json and a.quiet else (lambda m: print(m, file=sys.stderr,
                                                                        flush=True))
    log(f"checkpoint: {an['moe_layers']} MoE layers x {E} experts (top-{an['top_k']}), "
        f"{an['expert_bytes'] / GIB:.4f} GiB of experts, {an['bytes_per_expert']} B/expert; "
        f"budget {a.budget_gib} GiB -> {min(slots, E)} slots/layer "
        f"({min(slots, E) / E:.1%} of experts)")
    results = []
    for peer in [p for p in peers for _ in range(max(1, a.repeat))]:
        if not a.no_evict:
            evict_page_cache(an["shards"])
        before = page_cache_fraction(an["shards"])
        log(f"== {peer}: fresh process (shards in page cache: {before})")
        r = run_child({**base, "peer": peer}, a.timeout, verbose=not a.quiet)
        r["page_cache_before"] = before
        r["page_cache_after"] = page_cache_fraction(an["shards"])
        results.append(r)
        log(fmt_row(r))
        if not r.get("ok"):
            log("   " + "\n   ".join((r.get("traceback") or r.get("log_tail") or "")
                                     .strip().splitlines()[-12:]))
    ok = [r for r in results if r.get("ok")]
    ref = ok[0]["tokens"] if ok else None
    agree = {r["peer"]: (r["tokens"] == ref) for r in ok}
    for r in results:
        r.pop("tokens", None)
    summary = {}
    for peer in peers:
        rs = [r for r in results if r["peer"] == peer]
        good = sorted(r["run"]["decode_tok_s"] for r in rs if r.get("ok"))
        pre = sorted(r["run"]["prefill_s"] for r in rs if r.get("ok"))
        summary[peer] = {"runs": len(rs), "ok": len(good),
                         "decode_tok_s_median": good[len(good) // 2] if good else None,
                         "decode_tok_s_all": [round(x, 3) for x in good],
                         "prefill_s_median": pre[len(pre) // 2] if pre else None,
                         "errors": sorted({r.get("error") for r in rs if not r.get("ok")})}
    out = {"config": header, "summary": summary, "results": results,
           "tokens_agree_with_" + (ok[0]["peer"] if ok else "none"): agree}
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print(f"\n{an['model_type']} {','.join(an['dtypes'])}  budget {a.budget_gib} GiB = "
              f"{min(slots, E)}/{E} experts/layer  P={a.prompt_tokens} G={a.gen_tokens}")
        for r in results:
            print(fmt_row(r))
            if r.get("ok"):
                m = r.get("mapping", {})
                print("    mapping: " + json.dumps({k: v for k, v in m.items()
                                                    if k != "knob"}, default=str))
                print("    decode stats: " + json.dumps(r.get("stats_decode"), default=str))
            for n in r.get("notes") or []:
                print("    note: " + n)
            print(f"    page cache (shards) before/after: {r.get('page_cache_before')} / "
                  f"{r.get('page_cache_after')}")
        print("greedy tokens identical across peers: " + json.dumps(agree))
        if a.repeat > 1:
            for peer, v in summary.items():
                print(f"summary {peer:<15} median decode {v['decode_tok_s_median']} tok/s over "
                      f"{v['ok']}/{v['runs']} runs {v['decode_tok_s_all']}")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    if "--_child" in sys.argv:
        child_main(json.loads(sys.argv[sys.argv.index("--_child") + 1]))
    sys.exit(main())
