"""What an online policy knows of the traffic: the windows it keeps, the Rebalancer's sliding
sum, and the change detector that reads a placement's scores on them.

Legend: M = windows in memory, B = buckets of a sliding sum, H = candidate horizons, K = scored
windows kept, L = MoE layers, E = logical experts.

- `WindowMemory`: the newest windows, each kept whole, in a fixed ring (the adaptive and window
  policies' load estimate);
- `BucketedSum`: a sliding sum of observations in a bounded number of partial sums (the
  Rebalancer's `window=N`);
- `ChangeDetector`: which layers' newest window is far outside what their placement did on the
  windows before it (a real shift, not noise of the usual size);
- `HorizonChooser`: which of several memory lengths to plan on, chosen by how well decisions
  on each would have served the windows that followed (online model selection, past only).
Pure numpy; eplb.serving.policy re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, finite_number, is_whole, whole_number


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


def horizon_windows(windows_MLE: np.ndarray, order_M: np.ndarray, h: int,
                    recent_weight: bool) -> tuple[np.ndarray, np.ndarray]:
    """The windows a horizon of h plans on and their weights, ([M_h, L, E], [M_h]): the newest h
    of the kept windows (ring rows `order_M` of windows_MLE, oldest first) alone, or with
    `recent_weight` every kept window, the newest h counted 1 + round((n - h) / h) times so they
    weigh about as much as the older ones; every kept window alike where h covers them all."""
    n = len(order_M)
    if h >= n:
        return windows_MLE, np.ones(len(windows_MLE))
    if not recent_weight:
        return windows_MLE[order_M[n - h:]], np.ones(h)
    w_M = np.ones(len(windows_MLE))
    w_M[order_M[n - h:]] += max(1, round((n - h) / h))
    return windows_MLE, w_M


def true_or_false(name: str, v) -> bool:
    """v as a bool if it is one (or 0 / 1); a setting typed as other text is refused, not read as True."""
    if isinstance(v, (bool, np.bool_)) or (is_whole(v) and v in (0, 1)):
        return bool(v)
    raise EplbError(f"{name} must be true or false, got {v!r}")


def parse_horizons(horizons, memory: int) -> tuple[int, ...]:
    """Candidate horizons (windows) as an ascending tuple, from ints or text ("2,4,8,16"); each
    between 1 and `memory`, the windows kept."""
    if isinstance(horizons, str):
        parts = [h for h in horizons.replace(";", ",").split(",") if h.strip()]
        try:
            horizons = [int(h) for h in parts]
        except ValueError:
            raise EplbError(f"horizons must be whole numbers of windows separated by commas (e.g. 2,4,8,16), "
                            f"got {horizons!r}") from None
    elif np.ndim(horizons) == 0:
        horizons = [horizons]
    out = sorted({whole_number("each of horizons (windows)", h, 1) for h in horizons})
    if not out or out[-1] > memory:
        raise EplbError(f"horizons {out} must be 1 to memory ({memory}) windows: raise memory or drop the longer ones")
    return tuple(out)


class HorizonChooser:
    """Which memory length to plan on: the candidate whose decisions served the newest windows best.

    The errors come from the policy (`record`): for each window, before it joins the memory,
    what a decision made on each candidate horizon's windows would have served on it, as
    busiest / mean GPU above 1 plus the price of the moves that decision makes. The `samples`
    newest are kept per (horizon, layer), and a horizon is scored as the policy's decision
    scores a placement: half the mean, half the worst of its kept errors; summed over layers
    for the whole model (`per_layer` False), or per layer. Hysteresis: the horizon in use is
    left only for one whose score is lower by more than a share `margin` of its own, so noise
    does not flip it. Until a window has been scored the longest horizon is used.
    """

    def __init__(self, horizons: tuple[int, ...], samples: int, margin: float, per_layer: bool, num_layers: int):
        self.horizons = np.asarray(horizons, dtype=np.int64)
        self.samples = whole_number("horizon_samples", samples, 1)
        self.margin = finite_number("horizon_margin", margin, 0.0)
        self.per_layer = true_or_false("horizon_per_layer", per_layer)
        self._err_KHL = np.zeros((self.samples, len(horizons), num_layers))
        self._scored = 0
        self._pick_L = np.full(num_layers, len(horizons) - 1)       # index into horizons

    @property
    def nbytes(self) -> int:
        return int(self._err_KHL.nbytes)

    def record(self, err_HL: np.ndarray) -> None:
        """Record one window's error of every horizon, [H, L] (lower is better)."""
        self._err_KHL[self._scored % self.samples] = err_HL
        self._scored += 1

    def choose(self) -> np.ndarray:
        """The horizon to plan each layer on now (windows), int [L]."""
        if self._scored == 0:
            return self.horizons[self._pick_L]
        kept_KHL = self._err_KHL[:min(self._scored, self.samples)]
        score_HL = 0.5 * kept_KHL.mean(axis=0) + 0.5 * kept_KHL.max(axis=0)
        if not self.per_layer:
            score_HL = np.broadcast_to(score_HL.sum(axis=1, keepdims=True), score_HL.shape)
        layers = np.arange(score_HL.shape[1])
        best_L = np.argmin(score_HL, axis=0)
        switch_L = score_HL[best_L, layers] < (1.0 - self.margin) * score_HL[self._pick_L, layers]
        self._pick_L = np.where(switch_L, best_L, self._pick_L)
        return self.horizons[self._pick_L]
