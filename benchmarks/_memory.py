"""Peak resident memory of this process while a block runs (shared by the benchmarks that report memory)."""

from __future__ import annotations

import gc
import os
import threading


class PeakRSS:
    """Peak resident memory growth (bytes) while the block runs, sampled every 5 ms."""

    def __enter__(self) -> PeakRSS:
        gc.collect()  # garbage from earlier blocks must not count against (or for) this one
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base

    @property
    def growth_mb(self) -> float:
        return self.growth / 2**20
