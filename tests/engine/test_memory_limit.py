"""The memory limit auto budgets are sized against, read from fake cgroup trees on disk (this
machine has no memory controller to cap): the tightest limit over the process's group and its
ancestors, `max` as no limit, a missing controller, v1 and hybrid mounts, a subtree mount."""

from __future__ import annotations

from pathlib import Path

import psutil

from expert_stream.streaming.memory_limit import cgroup_limit, memory_limit

GIB = 1 << 30
V1_NONE = "9223372036854771712"  # what cgroup v1 writes for no limit


def fake_root(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A tree standing for `/`: /proc/self/cgroup, /proc/self/mountinfo and the limit files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")
    return tmp_path


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v2_nested_limits_take_the_tightest(tmp_path):
    root = fake_root(tmp_path, "0::/user.slice/app.scope/worker\n", V2_MOUNT, {
        "sys/fs/cgroup/user.slice/memory.max": str(8 * GIB),
        "sys/fs/cgroup/user.slice/app.scope/memory.max": "max",
        "sys/fs/cgroup/user.slice/app.scope/worker/memory.max": str(12 * GIB),
    })
    limit = cgroup_limit(root)
    assert limit.bytes == 8 * GIB and limit.source == "cgroup v2 memory.max of /user.slice"
    assert memory_limit(root=root) == limit  # tighter than this machine's memory
    (root / "sys/fs/cgroup/user.slice/app.scope/worker/memory.max").write_text(str(2 * GIB))
    assert cgroup_limit(root).bytes == 2 * GIB and cgroup_limit(root).source.endswith("/user.slice/app.scope/worker")


def test_max_everywhere_is_no_limit(tmp_path):
    root = fake_root(tmp_path, "0::/a/b\n", V2_MOUNT, {
        "sys/fs/cgroup/a/memory.max": "max", "sys/fs/cgroup/a/b/memory.max": "max"})
    assert cgroup_limit(root) is None
    limit = memory_limit(root=root)
    assert limit.source == "physical memory" and limit.bytes == psutil.virtual_memory().total


def test_missing_controller_is_no_limit(tmp_path):
    # The group exists but the memory controller is not enabled there: no memory.max files.
    root = fake_root(tmp_path, "0::/a\n", V2_MOUNT, {"sys/fs/cgroup/a/cgroup.controllers": "cpu io"})
    assert cgroup_limit(root) is None
    assert cgroup_limit(tmp_path / "nowhere") is None  # not Linux: no /proc/self/cgroup


def test_v1_and_hybrid_mounts(tmp_path):
    """A hybrid system: v2 at /sys/fs/cgroup/unified without the memory controller, v1 memory
    at /sys/fs/cgroup/memory, where "no limit" is a huge number."""
    mountinfo = ("41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
                 "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    root = fake_root(tmp_path, "4:memory:/jobs/one\n0::/\n", mountinfo, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NONE,
        "sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": str(6 * GIB),
        "sys/fs/cgroup/memory/jobs/one/memory.limit_in_bytes": V1_NONE,
    })
    limit = cgroup_limit(root)
    assert limit.bytes == 6 * GIB and limit.source == "cgroup v1 memory.limit_in_bytes of /jobs"


def test_a_mounted_subtree_starts_at_its_root(tmp_path):
    """A container that sees its own group mounted at /sys/fs/cgroup (mount root /docker/abc)."""
    mountinfo = "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = fake_root(tmp_path, "0::/docker/abc\n", mountinfo, {"sys/fs/cgroup/memory.max": str(3 * GIB)})
    assert cgroup_limit(root).bytes == 3 * GIB


def test_an_override_wins_and_is_named():
    assert memory_limit(5 * GIB, "expert_stream.memory_gib").source == "expert_stream.memory_gib"
    assert memory_limit(5 * GIB).bytes == 5 * GIB
