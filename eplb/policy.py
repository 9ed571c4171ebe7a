"""Online rebalancing policies: the load estimate, the change detector and the rule that decides
whether a rebalance pays for its moves.

Legend: M = windows kept in memory, B = buckets of a sliding sum, L = MoE layers, E = logical
experts, G = GPUs, S = slots per GPU, P = G x S physical slots.

A policy sees the traffic one *window* at a time (a batch of steps: `eplb replay` cuts a trace
into windows; the `Rebalancer` closes one every `interval` observations), always after the
window was served, and is asked for a `Decision` only between windows. It never sees a
window before it is served.

The default, `AdaptivePolicy` ("adaptive"):
- Load estimate: the newest `memory` windows, each kept whole (a bounded ring, `WindowMemory`).
  Planning is robust against every one of them (as the `robust` planner is), not against their
  sum, so regimes that alternate (prefill / decode) are hedged rather than chased.
- Change detector (`ChangeDetector`): the placement in force is scored on the window it just
  served; a layer whose busiest / mean GPU is far above what the same placement does on the
  windows before it (median + `detect` median absolute deviations) has met traffic its
  placement was not made for: a real shift, not noise of the usual size.
- Decision: a *repair* of the placement in force (`robust_repair`: replica counts moved
  towards what the memory needs, then at most `swaps` replica swaps per layer, `urgent_swaps`
  for layers the detector flagged) is kept per layer only where its predicted gain on the
  same memory pays for its moves: gain (half the mean, half the worst window of busiest /
  mean, in units of the layer's mean GPU load) > `move_cost` x moves. Layers that do not
  pay keep their replicas, so steady traffic costs no moves at all.

`WindowPolicy` ("window") is the fixed-horizon rule the `Rebalancer` implements with
`window=N`: plan on the sum of the newest N windows (all when None) with a planner, migration
aware (`eplb.plan(previous=...)`, move_cost 0.001), at every decision. `StaticPolicy`
("static") never rebalances. `get_policy` builds any of them by name with settings checked.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.errors import EplbError, finite_number, positive_number, whole_number
from eplb.migration import Budget, count_moves
from eplb.placement import Placement
from eplb.planner_api import get_planner
from eplb.planning import plan
from eplb.stats import replica_counts_minmax
from planners.robust import normalise_windows, refine_swaps, robust_demand, window_gpu_loads

# Load estimate --------------------------------------------------------------------------------

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

    def windows(self) -> np.ndarray:
        """Kept windows, oldest first, float64 [M, L, E] (a copy)."""
        n = len(self)
        idx = (np.arange(self.seen - n, self.seen)) % self.size
        return self._ring_MLE[idx]

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


def normalise(windows_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Scale each window and layer so the mean GPU load is 1 (idle ones stay 0), [M, L, E]."""
    return normalise_windows(windows_MLE, num_gpus)


def window_imbalance(phy2log_LP: np.ndarray, share_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest / mean GPU of a placement on each window under an even split, [M, L].

    share_MLE: windows from `normalise` (mean GPU load 1), so the busiest GPU's load is the ratio.
    """
    M, L, E = share_MLE.shape
    count_LE = _replica_counts(phy2log_LP, E)
    return window_gpu_loads(phy2log_LP, share_MLE, count_LE, num_gpus).max(axis=1).T


def _replica_counts(phy2log_LP: np.ndarray, num_logical_experts: int) -> np.ndarray:
    L = phy2log_LP.shape[0]
    flat = (np.arange(L)[:, None] * num_logical_experts + phy2log_LP).ravel()
    return np.bincount(flat, minlength=L * num_logical_experts).reshape(L, num_logical_experts)


# Change detector -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChangeDetector:
    """Flags layers whose newest window is far outside what their placement usually does.

    kappa: how many median absolute deviations above the median of the earlier windows the
      newest window's busiest / mean GPU must be; floor: the smallest deviation used (in units
      of the mean GPU load), so a layer that was perfectly steady does not fire on a tremor.
    """

    kappa: float = 8.0
    floor: float = 0.02

    def flags(self, imbalance_ML: np.ndarray) -> np.ndarray:
        """bool [L]: the last row is a shift against the rows before it (needs >= 3 of them)."""
        if self.kappa <= 0 or imbalance_ML.shape[0] < 4:
            return np.zeros(imbalance_ML.shape[1], dtype=bool)
        past_ML = imbalance_ML[:-1]
        med_L = np.median(past_ML, axis=0)
        mad_L = np.median(np.abs(past_ML - med_L), axis=0)
        return imbalance_ML[-1] > med_L + self.kappa * np.maximum(mad_L, self.floor)


# Repair: a few changes to the placement in force ---------------------------------------------------

def _fill_deficits(phy2log_LP: np.ndarray, target_LE: np.ndarray, share_MLE: np.ndarray,
                   num_gpus: int) -> np.ndarray:
    """Move replicas from experts above their target count to experts below it (one move each).

    Each new replica overwrites a slot of an expert with replicas to spare, on a GPU that does
    not hold the needy expert yet, choosing the GPU whose worst window is lightest.
    """
    phy = phy2log_LP.copy()
    L, P = phy.shape
    S = P // num_gpus
    E = target_LE.shape[1]
    gpu_P = np.arange(P) // S
    for l in np.flatnonzero((target_LE > _replica_counts(phy, E)).any(axis=1)):
        for e in np.flatnonzero(target_LE[l] > np.bincount(phy[l], minlength=E)):
            for _ in range(int(target_LE[l, e] - np.bincount(phy[l], minlength=E)[e])):
                count_E = np.bincount(phy[l], minlength=E)
                holds_G = np.zeros(num_gpus, dtype=bool)
                holds_G[gpu_P[phy[l] == e]] = True
                ok_P = (count_E[phy[l]] > target_LE[l, phy[l]]) & (count_E[phy[l]] > 1) & ~holds_G[gpu_P]
                if not ok_P.any():
                    break
                load_MG = (share_MLE[:, l, phy[l]] / count_E[phy[l]]).reshape(-1, num_gpus, S).sum(axis=2)
                cand = np.flatnonzero(ok_P)
                phy[l, cand[np.argmin(load_MG.max(axis=0)[gpu_P[cand]])]] = e
    return phy


def robust_repair(phy2log_LP: np.ndarray, share_MLE: np.ndarray, num_gpus: int, *, swaps: int,
                  beta: float = 50.0, blends=(0.0, 1.0)) -> np.ndarray:
    """The placement in force, changed a little to balance every window of `share_MLE`.

    Step 1: target replica counts, as the `robust` planner sets them (demand blending each
            expert's mean and worst share; each blend tried).
    Step 2: fill the experts below target from those above it (`_fill_deficits`).
    Step 3: at most `swaps` replica swaps per layer between a busiest GPU and another, each
            lowering the smooth maximum of GPU loads over all windows (planners.robust).
    Per layer, the blend whose result has the lowest worst-window busiest GPU is kept.
    share_MLE: windows from `normalise`. Returns phy2log_LP (a new array).
    """
    M, L, E = share_MLE.shape
    P = phy2log_LP.shape[1]
    best_LP = phy2log_LP.copy()
    best_L = window_imbalance(best_LP, share_MLE, num_gpus).max(axis=0)
    for blend in blends:
        target_LE = replica_counts_minmax(robust_demand(share_MLE, blend), P, max_replicas=num_gpus)
        phy = _fill_deficits(phy2log_LP, target_LE, share_MLE, num_gpus)
        if swaps:
            refine_swaps(phy, share_MLE, _replica_counts(phy, E), num_gpus, beta=beta, quantile=1.0,
                         max_rounds=swaps)
        score_L = window_imbalance(phy, share_MLE, num_gpus).max(axis=0)
        better = score_L < best_L - 1e-12
        best_LP[better] = phy[better]
        best_L = np.where(better, score_L, best_L)
    return best_LP


# Decisions -------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Decision:
    """What a policy wants served next (the engine migrates to it)."""

    phy2log_LP: np.ndarray
    """The new placement's slot map, [L, P] (rows of unchanged layers equal the old ones)."""
    changed_L: np.ndarray
    """Layers whose replicas change, bool [L]."""
    gain_L: np.ndarray
    """Predicted gain per layer on the policy's own estimate (busiest / mean GPU), [L]."""
    flagged_L: np.ndarray
    """Layers the change detector flagged, bool [L]."""
    reason: str = ""


class Policy(Protocol):
    """An online rebalancing rule: windows in (after they were served), decisions out."""

    name: str

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        """Record one served window's logical counts [L, E] and the placement that served it."""

    def decide(self, placement: Placement) -> Decision | None:
        """A new placement to migrate to from `placement`, or None to keep it."""

    @property
    def memory_bytes(self) -> int: ...


class AdaptivePolicy:
    """The default online policy (see the module docstring).

    memory: windows kept and planned against; swaps / urgent_swaps: replica swaps per layer per
    decision (urgent: layers the change detector flagged); move_cost: predicted gain (busiest /
    mean GPU, half mean and half worst window over the memory) each moved replica must buy;
    detect: change-detector threshold in median absolute deviations (0 = off); detect_floor:
    its smallest deviation; beta: sharpness of the smooth maximum the swaps lower.
    """

    name = "adaptive"

    def __init__(self, memory: int = 16, swaps: int = 8, urgent_swaps: int = 16, move_cost: float = 0.3,
                 detect: float = 8.0, detect_floor: float = 0.02, beta: float = 50.0):
        self.memory = whole_number("memory (windows)", memory, 1)
        self.swaps = whole_number("swaps", swaps, 0)
        self.urgent_swaps = whole_number("urgent_swaps", urgent_swaps, 0)
        self.move_cost = finite_number("move_cost", move_cost, 0.0)
        self.detector = ChangeDetector(finite_number("detect", detect, 0.0),
                                       finite_number("detect_floor", detect_floor, 0.0))
        self.beta = positive_number("beta", beta)
        self._mem: WindowMemory | None = None
        self._flag_L: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return 0 if self._mem is None else self._mem.nbytes

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        L, E = counts_LE.shape
        if self._mem is None:
            self._mem = WindowMemory(self.memory, L, E)
            self._flag_L = np.zeros(L, dtype=bool)
        self._mem.push(counts_LE)
        if len(self._mem) >= 4 and self.detector.kappa > 0:
            share = normalise(self._mem.windows(), placement.num_gpus)
            # Flags last until the next decision: windows served while a migration is in
            # flight are not lost.
            self._flag_L |= self.detector.flags(window_imbalance(placement.phy2log_LP, share, placement.num_gpus))

    def decide(self, placement: Placement) -> Decision | None:
        if self._mem is None or len(self._mem) == 0:
            return None
        G = placement.num_gpus
        share = normalise(self._mem.windows(), G)
        old_LP = placement.phy2log_LP
        flag_L = self._flag_L.copy()
        new_LP = robust_repair(old_LP, share, G, swaps=self.swaps, beta=self.beta)
        if flag_L.any() and self.urgent_swaps != self.swaps:
            urgent_LP = robust_repair(old_LP, share, G, swaps=self.urgent_swaps, beta=self.beta)
            new_LP[flag_L] = urgent_LP[flag_L]
        gain_L = _value(window_imbalance(old_LP, share, G)) - _value(window_imbalance(new_LP, share, G))
        moves_L = count_moves(old_LP, new_LP, G, placement.num_logical_experts).sum(axis=1)
        # A layer changes only where the predicted gain pays for every replica it moves: a
        # share moves / P of the price of moving all of the layer's slots.
        changed_L = (moves_L > 0) & (gain_L > self.move_cost * moves_L / placement.num_slots)
        self._flag_L[:] = False
        if not changed_L.any():
            return None
        new_LP = np.where(changed_L[:, None], new_LP, old_LP)
        why = f"{int(changed_L.sum())} layer(s) repaired ({int(flag_L.sum())} flagged by the change detector)"
        return Decision(new_LP, changed_L, np.where(changed_L, gain_L, 0.0), flag_L, why)


def _value(imbalance_ML: np.ndarray) -> np.ndarray:
    """Cost of a placement on the memory, [L]: half the mean, half the worst window."""
    return 0.5 * imbalance_ML.mean(axis=0) + 0.5 * imbalance_ML.max(axis=0)


class WindowPolicy:
    """Plan on the sum of the newest `window` windows (None: every window seen) at each decision.

    planner: an eplb planner name; move_cost: the migration-aware plan's price per move
    (eplb.migration.Budget), 0.001 as the Rebalancer's default.
    """

    name = "window"

    def __init__(self, window: int | None = 8, planner: str = "greedy", move_cost: float = 0.001):
        if isinstance(window, str) and window.lower() in ("all", "none"):
            window = None
        self.window = None if window is None else whole_number("window (windows)", window, 1)
        get_planner(planner)
        self.planner = planner
        self.budget = Budget(move_cost=finite_number("move_cost", move_cost, 0.0))
        self._mem: WindowMemory | None = None
        self._total_LE: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return (0 if self._mem is None else self._mem.nbytes) + (0 if self._total_LE is None else self._total_LE.nbytes)

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        if self.window is None:
            self._total_LE = counts_LE.astype(np.float64) if self._total_LE is None else self._total_LE + counts_LE
            return
        if self._mem is None:
            self._mem = WindowMemory(self.window, *counts_LE.shape)
        self._mem.push(counts_LE)

    def decide(self, placement: Placement) -> Decision | None:
        load_LE = self._total_LE if self.window is None else (None if self._mem is None else self._mem.total())
        if load_LE is None or load_LE.sum() <= 0:
            return None
        # The planner's map only: PlanResult.placement would also score a contiguous baseline.
        res = plan(load_LE, topology=placement.topology, planner=self.planner, previous=placement,
                   budget=self.budget)
        new_LP = res.solution.phy2log_LP
        changed_L = (new_LP != placement.phy2log_LP).any(axis=1)
        if not changed_L.any():
            return None
        L = new_LP.shape[0]
        return Decision(new_LP, changed_L, np.zeros(L), np.zeros(L, dtype=bool),
                        f"{self.planner} on the last {self.window or 'all'} window(s)")


class StaticPolicy:
    """Never rebalance: the placement made before serving stays (the reference a policy must beat)."""

    name = "static"
    memory_bytes = 0

    def observe(self, counts_LE: np.ndarray, placement: Placement) -> None:
        return None

    def decide(self, placement: Placement) -> Decision | None:
        return None


POLICIES: dict[str, type] = {"adaptive": AdaptivePolicy, "window": WindowPolicy, "static": StaticPolicy}
"""Policies by name; "adaptive" is the default of `eplb replay` and `Rebalancer(policy=...)`."""


def policy_settings(name: str) -> list[str]:
    """The settings a policy takes (its constructor's keywords)."""
    if name not in POLICIES:
        raise EplbError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return [k for k in inspect.signature(POLICIES[name]).parameters if k != "self"]


def get_policy(policy: str | Policy = "adaptive", settings: dict | None = None) -> Policy:
    """A fresh policy by name with settings checked, or a policy object as it is (no settings)."""
    if not isinstance(policy, str):
        if settings:
            raise EplbError(f"settings {sorted(settings)} apply to a policy given by name, not to a "
                            f"{type(policy).__name__} object: set them on the object")
        missing = [m for m in ("observe", "decide") if not callable(getattr(policy, m, None))]
        if missing:
            raise EplbError(f"policy must be a name ({', '.join(POLICIES)}) or have observe() and decide(); "
                            f"{type(policy).__name__} lacks {', '.join(missing)}")
        return policy
    known = policy_settings(policy)
    unknown = sorted(set(settings or {}) - set(known))
    if unknown:
        raise EplbError(f"policy {policy!r} has no setting {', '.join(map(repr, unknown))}; "
                        f"its settings are {', '.join(known) or 'none'}")
    return POLICIES[policy](**(settings or {}))
