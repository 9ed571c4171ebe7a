"""Which of the kept windows a decision of the adaptive policy plans on, and how they weigh: its
horizon, chosen online by how decisions on each candidate would have served what came next.

Legend: M = windows in memory, H = candidate horizons, K = scored windows kept, L = MoE layers,
E = logical experts.

- `horizon_windows`: the windows of one horizon and their weights;
- `parse_horizons`: candidate horizons from settings ("2,4,8,16");
- `HorizonChooser`: the candidate whose decisions served the newest windows best (online model
  selection, past only);
- `DriftTest`: whether the newest windows predict the next one better than a longer mean does
  (drift, or a topic shift: plan on them alone) or not (noise around a fixed mean: hedge on
  the whole memory). Pure numpy; eplb.serving.policy re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, finite_number, whole_number
from eplb.serving.load_estimate import true_or_false


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


@dataclass(frozen=True)
class DriftTest:
    """Does the traffic drift (follow the newest windows) or stay around a fixed mean (hedge on all)?

    Each candidate horizon h predicts every recent kept window by the mean share of the tokens
    over the h windows before it; the error is the squared difference of those shares, summed
    over experts and averaged over layers and over the windows predicted (the same windows for
    every candidate: those with `reference` windows before them). Around a fixed mean, sampling
    noise makes the longer mean the better prediction (error sigma^2 (1 + 1/h)); under drift, or
    after a topic shift, the shorter one wins. Past only: the windows predicted were served.

    horizons: the short candidates (windows, each below `reference`); reference: the long one,
    standing for the whole memory; margin: share of the reference's error the best short
    horizon must win by to count as drift (noise does not flip the choice); strong: the share
    it must win by to plan on the newest h windows alone; weight: otherwise, the share of the
    planning mean the newest h windows carry, every kept window still in the worst-window hedge
    (regimes that come back, prefill / decode, stay hedged).
    """

    horizons: tuple[int, ...] = (2, 4)
    reference: int = 8
    margin: float = 0.05
    strong: float = 0.5
    weight: float = 0.9

    def __post_init__(self) -> None:
        if any(h >= self.reference for h in self.horizons):
            raise EplbError(f"drift_horizons {self.horizons} must each be below drift_reference ({self.reference}) "
                            f"windows: drop the longer ones or raise drift_reference")
        for name in ("margin", "strong", "weight"):
            if not 0 <= getattr(self, name) < 1:
                raise EplbError(f"drift_{name} must be a share in [0, 1), got {getattr(self, name)!r}")

    def errors(self, windows_MLE: np.ndarray) -> np.ndarray | None:
        """Prediction error of each short horizon and then of the reference, [H + 1], on the kept
        windows (oldest first); None while fewer than reference + 1 windows are kept."""
        M = windows_MLE.shape[0]
        if M <= self.reference:
            return None
        share_MLE = windows_MLE / np.maximum(windows_MLE.sum(axis=2, keepdims=True), 1e-12)
        # Running sums: the mean of the h windows before window t is (c[t] - c[t - h]) / h.
        cum_MLE = np.concatenate([np.zeros((1, *share_MLE.shape[1:])), np.cumsum(share_MLE, axis=0)])
        t = np.arange(self.reference, M)
        out = []
        for h in (*self.horizons, self.reference):
            pred_TLE = (cum_MLE[t] - cum_MLE[t - h]) / h
            out.append(float(((share_MLE[t] - pred_TLE) ** 2).sum(axis=2).mean()))
        return np.asarray(out)

    def horizon(self, windows_MLE: np.ndarray) -> tuple[int, float] | None:
        """(the best short horizon (windows), its error over the reference's) where it wins by
        more than `margin`, else None: no drift seen."""
        err_H = self.errors(windows_MLE)
        if err_H is None or not self.horizons:
            return None
        best = int(np.argmin(err_H[:-1]))
        ratio = float(err_H[best] / max(err_H[-1], 1e-300))
        return (self.horizons[best], ratio) if ratio < 1.0 - self.margin else None

    def plan_windows(self, windows_MLE: np.ndarray, order_M: np.ndarray):
        """(h, windows [M_h, L, E], weights [M_h]) to plan on under drift, or None (no drift):
        strong drift, the newest h alone; else every kept window, the newest h carrying `weight`
        of the mean. windows_MLE in ring rows `order_M` (oldest first)."""
        found = self.horizon(windows_MLE[order_M])
        if found is None:
            return None
        h, ratio = found
        n = len(order_M)
        if ratio < 1.0 - self.strong or self.weight <= 0:
            return (h, *horizon_windows(windows_MLE, order_M, h, recent_weight=False))
        w_M = np.ones(len(windows_MLE))
        w_M[order_M[n - h:]] = self.weight / (1.0 - self.weight) * (n - h) / h
        return h, windows_MLE, w_M
