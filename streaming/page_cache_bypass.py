"""The `cache_bypass` setting: how the reader keeps expert reads out of the OS page cache, and
which mode this OS can give for the one asked.

- "direct": O_DIRECT reads of the aligned covering range (Linux);
- "fadvise": buffered reads, their pages dropped after (posix_fadvise DONTNEED);
- "nocache": buffered reads on descriptors marked F_NOCACHE (macOS);
- "none": the page cache is left alone;
- "auto": direct on Linux (the fastest there: README, Measured), nocache on macOS.
"""

from __future__ import annotations

import os
import sys

MODES = ("auto", "direct", "fadvise", "nocache", "none")
# The mode numbers native/reader.c takes.
MODE_CODE = {"none": 0, "fadvise": 1, "direct": 2, "nocache": 3}


def resolve(requested: str) -> tuple[str, str]:
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
