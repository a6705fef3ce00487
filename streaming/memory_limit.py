"""How much memory this process may use, and who says so.

The tightest of: the cgroup memory limits that apply to this process (v2 `memory.max` of its
group and every group above it; v1 `memory.limit_in_bytes` the same way), on Metal the
device's recommended working set (what macOS lets the GPU keep resident), and else the
machine's physical memory. Each answer names its source, so a budget built on it can say why.

`root` stands for `/`: tests point it at a fake tree of `proc/self/cgroup`,
`proc/self/mountinfo` and `sys/fs/cgroup/...` files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number (and some kernels
# a little less): anything from 2^62 bytes (4 EiB) up is no limit.
V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # e.g. "cgroup v2 memory.max of /user.slice/x", "physical memory"


def memory_limit(override_bytes: int | None = None, override_source: str = "memory_gib",
                 root: Path | str = "/") -> MemoryLimit:
    """The limit a budget is sized against: the override when given, else the tightest found."""
    if override_bytes is not None:
        return MemoryLimit(int(override_bytes), override_source)
    found = [physical_memory()]
    found += [limit for limit in (cgroup_limit(root), metal_working_set()) if limit is not None]
    return min(found, key=lambda limit: limit.bytes)


def physical_memory() -> MemoryLimit:
    import psutil

    return MemoryLimit(psutil.virtual_memory().total, "physical memory")


def metal_working_set() -> MemoryLimit | None:
    """Metal's recommended working set, from whichever device_info the installed MLX has."""
    import mlx.core as mx

    try:
        if not mx.metal.is_available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except (AttributeError, RuntimeError):
        return None
    size = info.get("max_recommended_working_set_size")
    return MemoryLimit(int(size), "Metal recommended working set") if size else None


def cgroup_limit(root: Path | str = "/") -> MemoryLimit | None:
    """The tightest cgroup memory limit over this process's group and its ancestors, or None
    (no memory controller, no limit set, not Linux)."""
    root = Path(root)
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _cgroup_mounts(root)
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount = mounts.get("cgroup2", (root / "sys/fs/cgroup", "/"))
            limits += _walk(mount, group, "memory.max", "cgroup v2 memory.max")
        elif "memory" in controllers.split(","):
            mount = mounts.get("memory", (root / "sys/fs/cgroup/memory", "/"))
            limits += _walk(mount, group, "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes")
    return min(limits, key=lambda limit: limit.bytes, default=None)


def _walk(mount: tuple[Path, str], group: str, filename: str, what: str) -> list[MemoryLimit]:
    """The limit files of `group` and every group above it (a parent's limit caps its children).
    A mount of a subtree (a container without its own cgroup namespace) starts at its root."""
    point, mount_root = mount
    if mount_root != "/" and (group + "/").startswith(mount_root.rstrip("/") + "/"):
        group = group[len(mount_root.rstrip("/")):]
    out = []
    parts = [p for p in group.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        here = "/" + "/".join(parts[:depth])
        try:
            text = (point.joinpath(*parts[:depth]) / filename).read_text().strip()
        except OSError:
            continue  # no memory controller in this group (or above the namespace)
        if text == "max" or not text.isdigit() or int(text) >= V1_UNLIMITED:
            continue
        out.append(MemoryLimit(int(text), f"{what} of {here}"))
    return out


def _cgroup_mounts(root: Path) -> dict[str, tuple[Path, str]]:
    """Where the cgroup hierarchies are mounted ("cgroup2", or v1's "memory" controller) and
    which group is the mount's root, from mountinfo; a hybrid system mounts v2 at
    /sys/fs/cgroup/unified."""
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return {}
    mounts = {}
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = (root / fields[4].lstrip("/"), fields[3])
        kind, _, options = line.split(" - ", 1)[1].partition(" ")
        if kind == "cgroup2":
            mounts["cgroup2"] = point
        elif kind == "cgroup" and "memory" in options.split()[-1].split(","):
            mounts["memory"] = point
    return mounts
