"""The checkpoint's shard files as the reader reads them: their descriptors, the page cache bypass
mode in use, and the check that each shard is still the file that was indexed.

- The `cache_bypass` modes: "direct" reads the aligned covering range with O_DIRECT (Linux);
  "fadvise" reads buffered, then drops the range's pages (posix_fadvise DONTNEED); "nocache"
  reads buffered on descriptors marked F_NOCACHE (macOS); "none" leaves the page cache alone;
  "auto" is direct on Linux (the fastest there: streaming/lab/MEASUREMENTS.md), nocache on macOS.
- Per file a buffered descriptor and, in direct mode, an O_DIRECT one; opened lazily (all of
  them at once where identities are checked), kept until close().
- A filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE and network ones), at
  open or at the first read, moves the mode to fadvise; `bypass` says what is used and `note`
  why it differs from what was asked.
- With identities (checkpoint.ShardIdentity per file), every shard is checked when opened and
  again after each batch; the first change fails that read and every later one.
"""

from __future__ import annotations

import errno as _errno
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence

from .errors import ReadError

_F_NOCACHE = 48  # macOS <sys/fcntl.h>

MODES = ("auto", "direct", "fadvise", "nocache", "none")
# The mode numbers native/reader.c takes.
MODE_CODE = {"none": 0, "fadvise": 1, "direct": 2, "nocache": 3}


def resolve_bypass(requested: str) -> tuple[str, str]:
    """-> (the mode used on this OS, a note saying why it differs from `requested`, or "")."""
    if requested not in MODES:
        raise ValueError(f"cache_bypass must be one of {', '.join(MODES)}, got {requested!r}")
    linux = sys.platform.startswith("linux")
    darwin = sys.platform == "darwin"
    has_direct = linux and hasattr(os, "O_DIRECT")
    has_fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
    if requested == "auto":
        if has_direct:
            return "direct", ""
        if linux and has_fadvise:
            return "fadvise", ""
        if darwin:
            return "nocache", ""
        return "none", f"no page cache bypass on {sys.platform}"
    if requested == "direct":
        if has_direct:
            return "direct", ""
        if darwin:
            return "nocache", "O_DIRECT does not exist on macOS: F_NOCACHE instead"
        if has_fadvise:
            return "fadvise", "O_DIRECT not available: fadvise instead"
        return "none", "O_DIRECT not available"
    if requested == "fadvise":
        if has_fadvise:
            return "fadvise", ""
        if darwin:
            return "nocache", "posix_fadvise does not exist on macOS: F_NOCACHE instead"
        return "none", "posix_fadvise not available"
    if requested == "nocache":
        if darwin:
            return "nocache", ""
        if has_fadvise:
            return "fadvise", "F_NOCACHE is macOS only: fadvise instead"
        return "none", "F_NOCACHE is macOS only"
    return "none", ""


class _DirectRefused(Exception):
    """The filesystem refused O_DIRECT at open."""


class ShardFiles:
    def __init__(self, paths: Sequence, cache_bypass: str, identities: Optional[Sequence] = None):
        self.paths: List[Path] = [Path(p) for p in paths]
        self.requested = cache_bypass
        self.bypass, self.note = resolve_bypass(cache_bypass)
        self.fds = [-1] * len(self.paths)  # buffered
        self.dfds = [-1] * len(self.paths)  # O_DIRECT, in direct mode
        self._lock = threading.Lock()
        self._closed = False
        self.identities = list(identities) if identities is not None else None
        self.failure: Optional[ReadError] = None  # the first change seen: every later read fails with it
        if self.identities is not None:
            try:
                self.open(range(len(self.paths)))
                for f, identity in enumerate(self.identities):
                    identity.check_open(self.fds[f])
                    if self.dfds[f] >= 0:
                        identity.check_now(self.dfds[f])
            except BaseException:
                self.close()
                raise

    def open(self, files) -> None:
        """Open the descriptors `files` need in the current mode (ReadError naming a file that
        does not open)."""
        fds, dfds = self.fds, self.dfds
        if all(fds[f] >= 0 for f in files) and (self.bypass != "direct" or all(dfds[f] >= 0 for f in files)):
            return
        with self._lock:
            if self._closed:
                raise ValueError("read on a closed ExpertReader")
            for f in files:
                if fds[f] < 0:
                    fds[f] = self._open(f, direct=False)
                if self.bypass == "direct" and dfds[f] < 0:
                    try:
                        dfds[f] = self._open(f, direct=True)
                    except _DirectRefused as exc:
                        self._fall_back_from_direct(str(exc))

    def refuse_direct(self, file: int) -> None:
        """O_DIRECT reads of `file` were refused (EINVAL) although it opened: fadvise from now on."""
        with self._lock:
            self._fall_back_from_direct(f"O_DIRECT reads refused on {self.paths[file]} (EINVAL): fadvise instead")

    def check(self, files) -> None:
        """The bytes just read from `files` came from the files the index described (no-op
        without identities); a change fails this read and every later one."""
        if self.identities is None:
            return
        if self.failure is not None:
            raise self.failure
        try:
            for f in files:
                self.identities[f].check_now(self.fds[f])
        except ReadError as exc:
            self.failure = exc
            raise

    def read_error(self, file: int, offset: int, length: int, err: int, pos: int) -> ReadError:
        """The error of a span read of `file` that failed with errno `err` (0: the file ended)
        at byte `pos`, naming the file, offset and length."""
        path = self.paths[file] if 0 <= file < len(self.paths) else f"<file {file}>"
        where = f"{length} bytes at offset {offset} of {path}"
        if err == 0:
            try:
                size_s = f"the file has {os.stat(path).st_size} bytes"
            except OSError:
                size_s = "the file is gone"
            return ReadError(f"short read: {where} were requested but the read stopped at byte {pos} "
                             f"({size_s}). The shard is truncated or changed since the checkpoint was indexed: "
                             f"re-download or re-convert the checkpoint.")
        name = _errno.errorcode.get(err, str(err))
        if err == _errno.EIO:
            hint = ("the disk or filesystem reported a failure: check the drive (dmesg / Disk Utility) or copy the "
                    "checkpoint to a healthy disk")
        elif err == _errno.EBADF:
            hint = "the file descriptor was closed: was the reader closed while a read was in flight?"
        elif err == _errno.EINVAL and self.bypass == "direct":
            hint = "O_DIRECT alignment was refused: use cache_bypass='fadvise'"
        else:
            hint = "check that the file is readable and the disk healthy"
        return ReadError(f"{name} ({os.strerror(err)}) reading {where} (failed at byte {pos}): {hint}.")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fds in (self.fds, self.dfds):
                for i, fd in enumerate(fds):
                    if fd >= 0:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                        fds[i] = -1

    def _open(self, f: int, *, direct: bool) -> int:
        path = self.paths[f]
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if direct and exc.errno in (_errno.EINVAL, _errno.EOPNOTSUPP, getattr(_errno, "ENOTSUP", -1)):
                raise _DirectRefused(f"O_DIRECT refused on {path} ({exc.strerror}): fadvise instead") from None
            if exc.errno == _errno.ENOENT:
                raise ReadError(f"shard file {path} does not exist (needed for a read): the checkpoint is incomplete "
                                f"or was moved; re-download it or point model_path at the complete directory") from None
            raise ReadError(f"cannot open shard file {path}: {exc.strerror} (errno {exc.errno}); check that it is a "
                            f"readable file") from None
        if not direct and sys.platform == "darwin" and self.bypass == "nocache":
            try:
                import fcntl
                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
            except OSError as exc:  # pragma: no cover - macOS only
                self.bypass, self.note = "none", f"F_NOCACHE refused ({exc.strerror})"
        return fd

    def _fall_back_from_direct(self, note: str) -> None:
        if self.bypass != "direct":
            return
        self.bypass, _ = resolve_bypass("fadvise")
        self.note = note
