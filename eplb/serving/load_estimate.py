"""What an online policy knows of the traffic: the windows it keeps, the Rebalancer's sliding
sum, and the change detector that reads a placement's scores on them.

Legend: M = windows in memory, B = buckets of a sliding sum, L = MoE layers, E = logical experts.

- `WindowMemory`: the newest windows, each kept whole, in a fixed ring (the adaptive and window
  policies' load estimate);
- `BucketedSum`: a sliding sum of observations in a bounded number of partial sums (the
  Rebalancer's `window=N`);
- `ChangeDetector`: which layers' newest window is far outside what their placement did on the
  windows before it (a real shift, not noise of the usual size);
Pure numpy; eplb.serving.policy re-exports every name. Which of the kept windows a decision
plans on (its horizon) is eplb.serving.horizons'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, is_whole, whole_number


class WindowMemory:
    """The newest `size` windows of logical counts, float64 [M, L, E], in a fixed ring.

    Memory is size x L x E x 8 bytes whatever a window holds (DeepSeek-V3, 58 x 256, 16
    windows: 1.9 MB).
    """

    def __init__(self, size: int, num_layers: int, num_logical_experts: int):
        self.size = whole_number("memory (windows)", size, 1)
        self._ring_MLE = np.zeros((self.size, num_layers, num_logical_experts))
        self.seen = 0

    def push(self, counts_LE: np.ndarray) -> None:
        self._ring_MLE[self.seen % self.size] = counts_LE
        self.seen += 1

    def __len__(self) -> int:
        return min(self.seen, self.size)

    def order(self) -> np.ndarray:
        """Ring rows of the kept windows, oldest first, int [M]."""
        return np.arange(self.seen - len(self), self.seen) % self.size

    def windows(self) -> np.ndarray:
        """Kept windows, oldest first, float64 [M, L, E] (a copy)."""
        return self._ring_MLE[self.order()]

    def total(self) -> np.ndarray:
        """Sum of the kept windows, [L, E]."""
        return self._ring_MLE.sum(axis=0) if self.seen >= self.size else self.windows().sum(axis=0)

    @property
    def nbytes(self) -> int:
        return int(self._ring_MLE.nbytes)


class BucketedSum:
    """Sum of the newest `window` observations kept as at most `buckets` partial sums, [L, E].

    Each bucket sums `width` = ceil(window / buckets) consecutive observations and window // width
    buckets are kept (the one being filled among them), so the sum spans between
    window - 2 x width + 2 and window of the newest observations (exactly `window` when
    window <= buckets, where width is 1). Memory is
    buckets x L x E x 8 bytes whatever the window (64 buckets at 58 x 256: 7.6 MB); a ring of
    every observation would grow with the window (1,000 observations: 119 MB).
    """

    def __init__(self, window: int, num_layers: int, num_logical_experts: int, buckets: int = 64):
        self.window = whole_number("window (observations)", window, 1)
        self.width = -(-self.window // whole_number("buckets", buckets, 1))
        self.num_buckets = self.window // self.width
        self._ring_BLE = np.zeros((self.num_buckets, num_layers, num_logical_experts))
        self.sum_LE = np.zeros((num_layers, num_logical_experts))
        self._seen = 0

    def add(self, counts_LE: np.ndarray) -> None:
        b = (self._seen // self.width) % self.num_buckets
        if self._seen % self.width == 0 and self._seen >= self.num_buckets * self.width:
            # A bucket is reused: its observations leave the window.
            self.sum_LE -= self._ring_BLE[b]
            self._ring_BLE[b] = 0.0
        self._ring_BLE[b] += counts_LE
        self.sum_LE += counts_LE
        self._seen += 1

    @property
    def nbytes(self) -> int:
        return int(self._ring_BLE.nbytes + self.sum_LE.nbytes)


@dataclass(frozen=True)
class ChangeDetector:
    """Flags layers whose newest window is far outside what their placement usually does.

    kappa: how many median absolute deviations above the median of the earlier windows the
      newest window's busiest / mean GPU must be; floor: the smallest deviation used (in units
      of the mean GPU load), so a layer that was perfectly steady does not fire on a tremor.
    """

    kappa: float = 8.0
    floor: float = 0.02
    MIN_WINDOWS = 4
    """Windows it needs (the newest and three before it) to tell a shift from noise."""

    def flags(self, imbalance_ML: np.ndarray) -> np.ndarray:
        """bool [L]: the last row is a shift against the rows before it (needs >= 3 of them)."""
        if self.kappa <= 0 or imbalance_ML.shape[0] < self.MIN_WINDOWS:
            return np.zeros(imbalance_ML.shape[1], dtype=bool)
        past_ML = imbalance_ML[:-1]
        med_L = np.median(past_ML, axis=0)
        mad_L = np.median(np.abs(past_ML - med_L), axis=0)
        return imbalance_ML[-1] > med_L + self.kappa * np.maximum(mad_L, self.floor)


def true_or_false(name: str, v) -> bool:
    """v as a bool if it is one (or 0 / 1); a setting typed as other text is refused, not read as True."""
    if isinstance(v, (bool, np.bool_)) or (is_whole(v) and v in (0, 1)):
        return bool(v)
    raise EplbError(f"{name} must be true or false, got {v!r}")
