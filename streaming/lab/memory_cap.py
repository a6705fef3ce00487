"""Running a process under a memory cap, page cache included (benchmark lab code): a cgroup v2
`memory.max`, so that a checkpoint larger than the cap cannot be served from RAM by a buffered
reader. Linux as root only; `unavailable_reason()` says why not elsewhere.

Over the cap the kernel reclaims the group's page cache first and OOM-kills last: a kill is a
result of the run (`CappedRun.killed`), not an error of whoever started it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExpertStreamError


class MemoryCapError(ExpertStreamError):
    """A memory cap was asked for where this OS or user cannot set one."""


def _cgroup2_mounts() -> list[Path]:
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    return [Path(parts[1]) for parts in (line.split() for line in lines) if len(parts) > 2 and parts[2] == "cgroup2"]


def _controllers(path: Path) -> list[str]:
    try:
        return (path / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def cgroup_root() -> Path | None:
    """The cgroup v2 mount whose memory controller is available, if any."""
    for mount in _cgroup2_mounts():
        if "memory" in _controllers(mount):
            return mount
    return None


def unavailable_reason() -> str | None:
    """Why a memory cap cannot be set here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return (f"a memory cap needs Linux cgroup v2; this is {sys.platform}, which has no per-process "
                "cap that covers the page cache")
    if os.geteuid() != 0:
        return "a memory cap needs root (it creates a cgroup under /sys/fs/cgroup); run as root or without --memory-cap"
    mounts = _cgroup2_mounts()
    if not mounts:
        return "no cgroup v2 hierarchy is mounted here (cgroup v1 only); a memory cap needs cgroup v2"
    if cgroup_root() is None:
        found = ", ".join(f"{m} (controllers: {' '.join(_controllers(m)) or 'none'})" for m in mounts)
        return (f"cgroup v2 is mounted ({found}) but its memory controller is not available there "
                "(it is bound to a cgroup v1 hierarchy); a memory cap needs the cgroup v2 memory controller")
    return None


@dataclass
class CappedRun:
    returncode: int
    stdout: str
    killed: bool  # OOM-killed under the cap (or killed by SIGKILL)
    oom_kills: int
    peak_bytes: int | None  # memory.peak of the group, where the kernel reports it


def run_capped(argv: list[str], cap_bytes: int, name: str = "expert-stream-bench") -> CappedRun:
    """Run `argv` (stdout captured, stderr passed through) inside a new cgroup v2 group whose
    memory.max is `cap_bytes` (swap off for it where the kernel has swap accounting)."""
    reason = unavailable_reason()
    if reason is not None:
        raise MemoryCapError(reason)
    root = cgroup_root()
    group = root / f"{name}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        if not (group / "memory.max").exists():
            # The parent must delegate the memory controller to its children.
            try:
                (root / "cgroup.subtree_control").write_text("+memory")
            except OSError as exc:
                raise MemoryCapError(
                    f"{root / 'cgroup.subtree_control'}: cannot hand the memory controller to child groups ({exc})"
                ) from exc
            group.rmdir()
            group.mkdir()
        if not (group / "memory.max").exists():
            raise MemoryCapError(f"{group}: no memory.max after enabling the memory controller")
        (group / "memory.max").write_text(str(int(cap_bytes)))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        # The child joins the group before it execs, so everything it allocates is charged there.
        shell = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        proc = subprocess.run(["/bin/sh", "-c", shell, str(group), *argv], stdout=subprocess.PIPE, text=True)
        oom = _oom_kills(group)
        peak = _read_int(group / "memory.peak")
        killed = oom > 0 or proc.returncode in (-9, 137)
        return CappedRun(proc.returncode, proc.stdout, killed, oom, peak)
    finally:
        try:
            group.rmdir()
        except OSError:
            pass


def _oom_kills(group: Path) -> int:
    try:
        for line in (group / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except OSError:
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
