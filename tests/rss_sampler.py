"""Peak resident memory of a block of code, sampled from a thread.

`ru_maxrss` is the peak of the whole process, imports included (importing torch through
transformers peaks near 2 GB and then drops), so it cannot show what a later step added.
Sampling the current RSS while the step runs can."""

from __future__ import annotations

import threading

import psutil


class PeakRSS:
    """with PeakRSS() as m: ...; m.grown is the peak RSS during the block minus RSS before it."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.process = psutil.Process()
        self.base = self.peak = 0
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def grown(self) -> int:
        return self.peak - self.base
