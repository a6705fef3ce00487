"""Builds native/resolve.cpp (the native decode path's primitive) against the MLX this process
imported, on first use, into a per-user cache keyed by the source and every version it was built
against: an MLX extension must match the MLX it runs in (its headers and nanobind's ABI), which a
wheel built at install time cannot promise once MLX is upgraded beside it.

On CUDA the build adds the GPU half (`-DEXPERT_STREAM_CUDA`): the landing kernel
(land_rows.cu) compiled by the CUDA toolkit's nvcc (CUDA_HOME, or nvcc on PATH) to PTX that the
driver compiles for the GPU at load, and the CUDA runtime linked from the same toolkit.

`load(cuda)` returns the module, or None and why (no compiler, no nanobind, no CUDA toolkit, a
failed build or import): the caller keeps the Python path and says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("resolve.cpp")
KERNEL = Path(__file__).with_name("land_rows.cu")
SHIM = Path(__file__).with_name("cuda_shim")  # MLX's CUDA headers include fmt, which its wheel lacks


def cache_dir() -> Path:
    root = os.environ.get("EXPERT_STREAM_NATIVE_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "expert-stream" / "native"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("c++", "clang++", "g++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cuda_home() -> Path | None:
    """The CUDA toolkit to build the GPU half with: CUDA_HOME, else the one nvcc on PATH is in,
    else /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), _parent_of(shutil.which("nvcc")), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists() and (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root)
    return None


def _parent_of(nvcc: str | None) -> str | None:
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def _kernel_command(cuda: Path, out: Path) -> list[str]:
    # PTX for the oldest architecture CUDA 12/13 build for: the driver compiles it for this GPU.
    return [str(cuda / "bin" / "nvcc"), "-O2", "-std=c++17", "--gpu-architecture=compute_75", "-Xcompiler", "-fPIC",
            "-c", str(KERNEL), "-o", str(out)]


def _command(cxx: str, out: Path, cuda: Path | None = None, kernel: Path | None = None) -> list[str]:
    import mlx
    import nanobind

    mlx_dir = Path(list(mlx.__path__)[0])
    nb_dir = Path(nanobind.source_dir()).parent
    cmd = [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-DNB_DOMAIN=mlx",
           f"-I{mlx_dir / 'include'}", f"-I{sysconfig.get_paths()['include']}", f"-I{nanobind.include_dir()}",
           f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", str(SOURCE), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
           f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(out)]
    if sys.platform == "darwin":
        cmd[1:1] = ["-undefined", "dynamic_lookup"]
    if cuda is not None:
        lib = cuda / ("lib64" if (cuda / "lib64").exists() else "lib")
        cmd[1:1] = ["-DEXPERT_STREAM_CUDA", f"-I{cuda / 'include'}", f"-I{mlx_dir / 'include' / 'cccl'}", f"-I{SHIM}"]
        cmd[-2:-2] = [str(kernel), f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"]
    return cmd


def _key(cxx: str, cuda: Path | None) -> str:
    import mlx.core as mx
    import nanobind

    h = hashlib.sha256(SOURCE.read_bytes())
    parts = [mx.__version__, nanobind.__version__, sysconfig.get_config_var("EXT_SUFFIX"), sys.platform, cxx]
    if cuda is not None:
        h.update(KERNEL.read_bytes())
        parts.append(cuda.resolve())
    for part in parts:
        h.update(str(part).encode())
    return h.hexdigest()[:16]


def load(cuda: bool = False):
    """-> (module, "") or (None, why it cannot load); `cuda`: with the GPU half. Builds once per
    key; later processes (a host's children) import the cached build. The caller decides once
    a process (native_decode.native_module)."""
    try:
        import nanobind  # noqa: F401
    except ImportError:
        return None, "nanobind is not installed (pip install nanobind)"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    toolkit = None
    if cuda:
        toolkit = cuda_home()
        if toolkit is None:
            return None, "its CUDA half needs the CUDA toolkit (nvcc and headers: set CUDA_HOME)"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    folder = cache_dir() / _key(cxx, toolkit)
    target = folder / f"_resolve{suffix}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build where several processes start at once
            if not target.exists():
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    built = Path(tmp) / target.name
                    steps = [(SOURCE.name, cxx, _command(cxx, built))]
                    if toolkit is not None:
                        kernel = Path(tmp) / "land_rows.o"
                        steps = [(KERNEL.name, "nvcc", _kernel_command(toolkit, kernel)),
                                 (SOURCE.name, cxx, _command(cxx, built, toolkit, kernel))]
                    for name, tool, cmd in steps:
                        done = subprocess.run(cmd, capture_output=True, text=True)
                        if done.returncode != 0:
                            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                            return None, f"building {name} with {tool} failed: {' / '.join(tail)}"
                    os.replace(built, target)
    except OSError as exc:
        return None, f"cannot build into {folder}: {exc}"
    try:
        spec = importlib.util.spec_from_file_location("_resolve", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # a build for another MLX left behind, an ABI mismatch
        return None, f"importing {target} failed: {exc}"
    return module, ""
