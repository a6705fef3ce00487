"""What a soak counts and prints: requests by verdict, the longest wait, faults, reloads applied
and refused, restarts, and the server's resources (RSS of its process tree, peak and growth;
open files and threads at the end)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from .client import CLEAR, EXACT, HANG, SERVER_DOWN, UNCLEAR, WRONG

KEPT_FAILURES = 40  # the first ones are kept with their text; all are counted


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.verdicts: Counter = Counter()
        self.by_model: Counter = Counter()
        self.counts: Counter = Counter()
        self.faults: Counter = Counter()
        self.failures: list[str] = []
        self.failure_count = 0
        self.longest_wait = 0.0
        self.samples: list[tuple] = []  # (t, rss bytes, open files, threads)
        self.paths: dict[str, set] = {}  # model -> the decode paths its status named during the run

    def verdict(self, model: str, verdict) -> None:
        with self.lock:
            self.verdicts[verdict.kind] += 1
            self.by_model[(model, verdict.kind)] += 1
            self.longest_wait = max(self.longest_wait, verdict.seconds)
        if verdict.kind in (WRONG, HANG, UNCLEAR):
            self.failure(f"{model}: {verdict.kind} after {verdict.seconds:.1f} s: {verdict.detail}")

    def failure(self, text: str) -> None:
        with self.lock:
            self.failure_count += 1
            if len(self.failures) < KEPT_FAILURES:
                self.failures.append(f"[{time.strftime('%H:%M:%S')}] {text}")

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n

    def fault(self, name: str) -> None:
        with self.lock:
            self.faults[name] += 1

    def reload_applied(self, way: str) -> None:
        self.count(f"reloads applied ({way})")

    def reload_refused(self, edit: str) -> None:
        self.count("invalid edits refused")
        self.count(f"refused: {edit}")

    def sample(self, rss: int, files: int, threads: int) -> None:
        with self.lock:
            self.samples.append((time.time(), rss, files, threads))

    def saw_paths(self, models: dict) -> None:
        """The decode path each loaded streamed model's status names (GET /expert-stream/status),
        with its note where it has one (why native does not serve it)."""
        with self.lock:
            for name, model in models.items():
                stats = model.get("stats") or {}
                if stats.get("decode_path"):
                    note = stats.get("decode_path_note")
                    self.paths.setdefault(name, set()).add(stats["decode_path"] + (f" ({note})" if note else ""))

    def progress(self) -> str:
        with self.lock:
            return (f"{sum(self.verdicts.values())} requests ({self.verdicts[EXACT]} exact, "
                    f"{self.verdicts[CLEAR]} clear errors), {sum(self.faults.values())} faults, "
                    f"{self.failure_count} failures")

    def summary(self, header: dict, server: dict) -> dict:
        """Everything counted, as one document (printed by `lines`)."""
        requests = sum(self.verdicts.values())
        rss = [s[1] for s in self.samples]
        warm = max(rss[:max(5, len(rss) // 10)], default=0)  # the first tenth's top: models loaded
        return {
            **header,
            "requests": requests, "exact": self.verdicts[EXACT], "clear errors": self.verdicts[CLEAR],
            "wrong": self.verdicts[WRONG], "hangs": self.verdicts[HANG], "unclear errors": self.verdicts[UNCLEAR],
            "no server (killed by the soak)": self.verdicts[SERVER_DOWN],
            "longest wait s": round(self.longest_wait, 1),
            "by model": {f"{m} {k}": n for (m, k), n in sorted(self.by_model.items())},
            "faults": dict(sorted(self.faults.items())), "counts": dict(sorted(self.counts.items())),
            **server,
            "decode paths": {m: sorted(p) for m, p in sorted(self.paths.items())},
            "rss MiB (after warm-up, peak, end)": [round(x / 2**20, 1) for x in (warm, max(rss, default=0),
                                                                                rss[-1] if rss else 0)],
            "rss growth MiB": round(((rss[-1] if rss else 0) - warm) / 2**20, 1),
            "open files (start, end)": [self.samples[0][2], self.samples[-1][2]] if self.samples else None,
            "threads (start, end)": [self.samples[0][3], self.samples[-1][3]] if self.samples else None,
            "failures": self.failure_count, "first failures": list(self.failures),
        }


def lines(summary: dict) -> list[str]:
    out = []
    for key, value in summary.items():
        if isinstance(value, dict):
            out.append(f"{key}:")
            out += [f"  {k}: {v}" for k, v in value.items()]
        elif isinstance(value, list) and key == "first failures":
            out.append(f"{key}:" if value else f"{key}: none")
            out += [f"  {v}" for v in value]
        else:
            out.append(f"{key}: {value}")
    return out


def sample_tree(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open files, threads) of a process and all its descendants."""
    import psutil

    rss = files = threads = 0
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0
    for p in tree:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                files += p.num_fds()
                threads += p.num_threads()
        except psutil.Error:
            pass
    return rss, files, threads
