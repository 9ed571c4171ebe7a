"""Load statistics: window aggregation, skew metrics, lower bounds, GPU-load evaluation.

Legend: T = time windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.
Loads are token-slot counts (one token routed to K experts counts K times), as float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eplb.errors import EplbError, a_name, is_number, is_whole, number_array, whole_number

if TYPE_CHECKING:
    from eplb.core.topology import Topology

AGGREGATIONS = ("sum", "mean", "last", "window", "ema")


def _check_alpha(alpha) -> float:
    if not is_number(alpha) or not 0.0 < float(alpha) <= 1.0:
        raise EplbError(f"EMA alpha must be in (0, 1] (a number), got {alpha!r}")
    return float(alpha)


def _as_counts_TLE(counts) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise EplbError(f"counts must be [windows, layers, experts] or [layers, experts], got shape {c.shape}")
    return c


@dataclass(frozen=True)
class Aggregation:
    """How windows collapse into one planning load [L, E] (`aggregate` applies it).

    how: "sum" (all windows), "mean", "last" (newest window), "window" (sum of the newest
    `window` windows), "ema" (exponential moving average with weight `alpha` on the newest
    window, default 0.3, computed oldest to newest, so the result is on the scale of one window).
    """

    how: str = "sum"
    window: int | None = None
    """Windows summed by "window" (a whole number >= 1); only with how="window"."""
    alpha: float | None = None
    """Weight of the newest window for "ema", in (0, 1]; only with how="ema"."""

    def __post_init__(self) -> None:
        a_name("aggregation", self.how, AGGREGATIONS)  # before the comparisons below meet an array
        # A window or alpha the chosen aggregation would not use is a mistake, not a no-op.
        if self.window is not None and self.how != "window":
            raise EplbError(f"window ({self.window!r}) only applies to aggregation 'window', not {self.how!r}: "
                            f"add --aggregate window (aggregate='window') or drop the window")
        if self.alpha is not None and self.how != "ema":
            raise EplbError(f"alpha ({self.alpha!r}) only applies to aggregation 'ema', not {self.how!r}: "
                            f"add --aggregate ema (aggregate='ema') or drop alpha")
        if self.how not in AGGREGATIONS:
            raise EplbError(f"unknown aggregation {self.how!r}: choose one of {', '.join(AGGREGATIONS)}")
        if self.how == "window":
            if self.window is None or not is_whole(self.window) or int(self.window) < 1:  # int(2.5) would sum 2
                raise EplbError(f"aggregation 'window' needs window >= 1, got {self.window!r} "
                                f"(a whole number of windows)")
            object.__setattr__(self, "window", int(self.window))
        if self.alpha is not None:
            object.__setattr__(self, "alpha", _check_alpha(self.alpha))

    def __call__(self, counts_TLE) -> np.ndarray:
        """The planning load [L, E] of counts [T, L, E] (or [L, E], one window)."""
        c = _as_counts_TLE(counts_TLE)
        if self.how == "sum":
            return c.sum(axis=0)
        if self.how == "mean":
            return c.mean(axis=0)
        if self.how == "last":
            return c[-1].copy()
        if self.how == "window":
            return c[-self.window:].sum(axis=0)
        return ema(c, 0.3 if self.alpha is None else self.alpha)[-1]


def aggregate(counts_TLE, how: str | Aggregation = "sum", *, window: int | None = None,
              alpha: float | None = None) -> np.ndarray:
    """Collapse windows into one load [L, E]: `how` is an Aggregation, or its name with
    `window` / `alpha` (see Aggregation)."""
    return as_aggregation(how, window=window, alpha=alpha)(counts_TLE)


def as_aggregation(how: str | Aggregation, *, window: int | None = None, alpha: float | None = None) -> Aggregation:
    """An Aggregation from a value or a name (+ window / alpha); a value takes no extra options."""
    if isinstance(how, Aggregation):
        if window is not None or alpha is not None:
            raise EplbError(f"give window / alpha inside the Aggregation ({how}), not beside it")
        return how
    return Aggregation(how, window, alpha)


def sliding_sum(counts_TLE, size: int) -> np.ndarray:
    """Sum over each run of `size` consecutive windows, [T - size + 1, L, E]."""
    c = _as_counts_TLE(counts_TLE)
    if not is_whole(size) or not 1 <= size <= c.shape[0]:
        raise EplbError(f"sliding window size must be a whole number in 1..{c.shape[0]} (the number of windows), "
                        f"got {size!r}")
    size = int(size)
    # Each run summed on its own: differences of a running sum lose a small window after a
    # large one (a window of 1e-3 after one of 1e10 would come out as 9.9945e-4).
    return np.lib.stride_tricks.sliding_window_view(c, size, axis=0).sum(axis=-1)


def ema(counts_TLE, alpha: float) -> np.ndarray:
    """Exponential moving average over windows, [T, L, E]: m_t = alpha x_t + (1 - alpha) m_{t-1}."""
    alpha = _check_alpha(alpha)  # "0.5" passed float() here, then failed as a UFuncTypeError
    c = _as_counts_TLE(counts_TLE)
    out = np.empty_like(c)
    m = c[0]
    for t in range(c.shape[0]):
        m = c[t] if t == 0 else alpha * c[t] + (1.0 - alpha) * m
        out[t] = m
    return out


# Skew of the logical load ---------------------------------------------------------------------

def hot_ratio(load_LE) -> np.ndarray:
    """Hottest expert / mean expert load per layer, [L] (1 = perfectly even; 0-load layers give 1)."""
    load = np.asarray(load_LE, dtype=np.float64)
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1), 1.0)


def gini(load_LE) -> np.ndarray:
    """Gini coefficient of expert loads per layer, [L] (0 = even, -> 1 = one expert takes all)."""
    x = np.sort(np.asarray(load_LE, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    total = x.sum(axis=-1)
    ranks = np.arange(1, n + 1)
    g = (2 * (ranks * x).sum(axis=-1) / np.where(total > 0, total, 1) - (n + 1)) / n
    return np.where(total > 0, g, 0.0)


# GPU-level balance ----------------------------------------------------------------------------

def imbalance(gpu_load_LG) -> np.ndarray:
    """Busiest GPU / mean GPU load per layer, [L] (1 = perfect; idle layers give 1)."""
    g = np.asarray(gpu_load_LG, dtype=np.float64)
    mean = g.mean(axis=-1)
    return np.where(mean > 0, g.max(axis=-1) / np.where(mean > 0, mean, 1), 1.0)


def balancedness(gpu_load_LG) -> float:
    """vLLM's balancedness: sum over layers of mean GPU load / sum of max GPU load (1 = perfect)."""
    g = np.asarray(gpu_load_LG, dtype=np.float64)
    mx = g.max(axis=-1).sum()
    return float(g.mean(axis=-1).sum() / mx) if mx > 0 else 1.0


def window_balancedness(placement, counts_TLE) -> np.ndarray:
    """`balancedness` of a placement on each window alone, [T] (empty windows give 1).

    A plan made for the summed history can look balanced on the sum yet leave single windows
    (a prefill burst, a code-heavy minute) skewed; this is what each window saw."""
    c = _as_counts_TLE(counts_TLE)
    return np.array([balancedness(placement.gpu_loads(c[t])) for t in range(c.shape[0])])


def group_span(phy2log_LP: np.ndarray, topology: Topology, num_expert_groups: int,
               num_logical_experts: int) -> np.ndarray:
    """Number of nodes of `topology` holding any replica of each expert group, int [L, K] (1 = fully local).

    Groups are num_expert_groups blocks of num_logical_experts / num_expert_groups consecutive experts (DeepSeek-V3's
    group-limited routing sends a token to at most 4 of 8 groups); a group on one node keeps a
    token's traffic to that group on the node's fast links. Empty slots (-1) hold nothing."""
    L, P = phy2log_LP.shape
    num_nodes = topology.num_nodes
    node_P = (np.arange(P) // (P // topology.num_gpus)) // (topology.num_gpus // num_nodes)
    group_LP = phy2log_LP // (num_logical_experts // num_expert_groups)
    present_LKN = np.zeros((L, num_expert_groups, num_nodes), dtype=bool)
    valid = phy2log_LP >= 0
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    present_LKN[rows[valid], group_LP[valid], np.broadcast_to(node_P, (L, P))[valid]] = True
    return present_LKN.sum(axis=2)


def replica_counts_minmax(load_LE, num_slots: int, max_replicas: int | None = None,
                          tie_break: bool = True) -> np.ndarray:
    """Replica counts r [L, E] (sum P, each >= 1) minimising max_e load_e / r_e, per layer.

    Giving each next slot to the expert with the highest load per replica is optimal for this
    min-max objective (exchange argument). `max_replicas` caps r_e (e.g. at G, since two
    replicas of one expert on one GPU never help). `tie_break` spreads ties (e.g. an idle
    layer's slots) over the experts in id order through a bonus of 1e-9 of the layer's hottest
    load; that bonus can also decide between loads closer than it, so the exact optimum (what
    `lower_bound` needs) takes tie_break=False.
    """
    load = np.asarray(load_LE, dtype=np.float64)
    L, E = load.shape
    if num_slots < E:
        raise EplbError(f"{num_slots} physical slots cannot hold {E} logical experts")
    cap = num_slots if max_replicas is None else int(max_replicas)
    if cap * E < num_slots:
        raise EplbError(f"{num_slots} slots need more than {cap} replicas of some of the {E} experts")
    r = np.ones((L, E), dtype=np.int64)
    rows = np.arange(L)
    # Ties (e.g. all-zero layers) go to the lower expert id: a tiny id-dependent bonus.
    key_LE = load + 1e-9 * np.maximum(load.max(axis=1, keepdims=True), 1.0) * (E - np.arange(E)) / E \
        if tie_break else load
    per_LE = np.where(r >= cap, -np.inf, key_LE)
    for _ in range(num_slots - E):
        e = np.argmax(per_LE, axis=1)
        r[rows, e] += 1
        re = r[rows, e]
        per_LE[rows, e] = np.where(re >= cap, -np.inf, key_LE[rows, e] / re)
    return r


def lower_bound(load_LE, num_gpus: int, num_slots: int) -> np.ndarray:
    """Lower bound on the busiest GPU's load per layer, [L].

    max(total / G, min over replica counts r (sum r = P, r_e >= 1) of max_e load_e / r_e):
    no placement, however tokens are split among replicas, can beat either term.
    """
    num_gpus, num_slots = whole_number("num_gpus", num_gpus, 1), whole_number("num_slots", num_slots, 1)
    load = _loads_LE(load_LE)
    L, E = load.shape
    if num_slots < E:
        raise EplbError(f"{num_slots} physical slots cannot hold {E} logical experts")
    return np.maximum(load.sum(axis=1) / num_gpus, _minmax_per_replica(load, int(num_slots)))


def _minmax_per_replica(load_LE: np.ndarray, num_slots: int) -> np.ndarray:
    """min over replica counts r (sum r <= P, r_e >= 1) of max_e load_e / r_e, per layer, [L].

    Bisection on the level t (t is feasible when sum_e max(1, ceil(load_e / t)) <= P), so the
    cost is independent of P: a greedy over slots would take P - E steps, and P is a caller's
    number here (10**30 must not hang). The counts of the feasible end give the exact value.
    """
    L, E = load_LE.shape
    if E == 0 or L == 0:
        return np.zeros(L)
    hi = load_LE.max(axis=1)  # r = 1 everywhere is feasible (P >= E)
    lo = np.zeros(L)
    for _ in range(200):
        mid = (lo + hi) / 2
        if not np.any((mid > lo) & (mid < hi)):
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.where(mid[:, None] > 0, np.maximum(1.0, np.ceil(load_LE / np.where(mid > 0, mid, 1.0)[:, None])),
                            np.inf).sum(axis=1)
        ok = need <= num_slots
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    with np.errstate(divide="ignore", invalid="ignore"):
        r_LE = np.where(hi[:, None] > 0, np.maximum(1.0, np.ceil(load_LE / np.where(hi > 0, hi, 1.0)[:, None])), 1.0)
    return (load_LE / r_LE).max(axis=1)


def _loads_LE(load_LE) -> np.ndarray:
    """Loads [L, E] of a public call as float64: numbers, finite, non-negative, 2-D."""
    load = number_array("loads", load_LE).astype(np.float64)
    if load.ndim != 2:
        raise EplbError(f"loads must be [layers, experts], got shape {load.shape}")
    if not np.all(np.isfinite(load)) or (load.size and load.min() < 0):
        raise EplbError("loads must be finite and non-negative token counts")
    return load


@dataclass(frozen=True)
class LoadReport:
    """How a placement balances a given logical load, per layer."""

    gpu_load_LG: np.ndarray
    """Tokens per GPU, [L, G]."""
    imbalance_L: np.ndarray
    """Busiest GPU / mean GPU, [L]."""
    bound_ratio_L: np.ndarray
    """Busiest GPU / lower bound, [L] (>= 1)."""
    balancedness: float
    """vLLM's balancedness over all layers."""

    def summary(self) -> dict:
        """min / median / max of the per-layer ratios, and the overall balancedness."""
        def mmm(a):
            return {"min": float(np.min(a)), "median": float(np.median(a)), "max": float(np.max(a)),
                    "mean": float(np.mean(a))}
        return {"imbalance": mmm(self.imbalance_L), "bound_ratio": mmm(self.bound_ratio_L),
                "balancedness": self.balancedness}

    def metrics(self) -> dict[str, float]:
        """The scores a placement file carries in `metrics` (eplb plan -o, the Rebalancer)."""
        return {"imbalance_median": median(self.imbalance_L),
                "imbalance_max": float(self.imbalance_L.max()),
                "bound_ratio_max": float(self.bound_ratio_L.max()),
                "balancedness": self.balancedness}


def median(a_N: np.ndarray) -> float:
    """`float(np.median(a_N))` to the bit (NaN when a_N holds one), without its generic
    machinery: a layer count of numbers is sorted faster than np.median dispatches."""
    s_N = np.sort(a_N, axis=None)
    n = s_N.size
    if n == 0 or np.isnan(s_N[-1]):  # np.sort puts NaN last
        return float("nan")
    h = n // 2
    return float(s_N[h]) if n % 2 else float((s_N[h - 1] + s_N[h]) / 2)


def load_report(gpu_load_LG: np.ndarray, lower_bound_L: np.ndarray) -> LoadReport:
    """The report of tokens per GPU [L, G] against the layers' lower bound [L]."""
    lb = lower_bound_L
    ratio = np.where(lb > 0, gpu_load_LG.max(axis=1) / np.where(lb > 0, lb, 1), 1.0)
    return LoadReport(gpu_load_LG, imbalance(gpu_load_LG), ratio, balancedness(gpu_load_LG))


def evaluate(placement, load_LE, weights_LP: np.ndarray | None = None,
             lower_bound_L: np.ndarray | None = None) -> LoadReport:
    """Score a placement on a logical load [L, E] (dispatch weights of the plan unless given).

    lower_bound_L: `lower_bound(load_LE, G, P)` when the caller already has it (it is the same
    for every placement of one load on one topology), so scoring several plans computes it once.
    """
    if not hasattr(placement, "gpu_loads"):  # the Placement class sits above this module
        raise EplbError(f"evaluate needs an eplb Placement first, got {type(placement).__name__}: "
                        f"evaluate(placement, load_LE)")
    load = _loads_LE(load_LE)
    gpu_LG = placement.gpu_loads(load, weights_LP)
    lb = lower_bound(load, placement.num_gpus, placement.num_slots) if lower_bound_L is None else lower_bound_L
    return load_report(gpu_LG, lb)


# Scores of an even split ---------------------------------------------------------------------

def even_gpu_loads(placement, load_LE: np.ndarray) -> np.ndarray:
    """Tokens per GPU [L, G] when every expert's tokens split evenly over its replicas: bit for
    bit `placement.gpu_loads(load_LE)` (the same products, load x (1 / count), summed in slot
    order), but each product made once per expert [L, E] and gathered through flat indices.
    Trusts load_LE: float64 [L, E] of the placement's shape."""
    phy_LP = placement.phy2log_LP
    L, P = phy_LP.shape
    E = placement.num_logical_experts
    per_LE = load_LE * (1.0 / placement.replica_count_LE)
    slot_LP = per_LE.ravel()[phy_LP + (np.arange(L) * E)[:, None]]
    return slot_LP.reshape(L, placement.num_gpus, P // placement.num_gpus).sum(axis=-1)


def even_report(placement, load_LE: np.ndarray, lower_bound_L: np.ndarray) -> LoadReport:
    """`evaluate(placement, load_LE, placement.replica_weights(), lower_bound_L)` for a placement
    split evenly among its replicas (no dispatch weights), to the bit, without the per-slot
    weights (`even_gpu_loads`). Trusts its input: load_LE float64 [L, E] of the placement's
    shape, finite and >= 0, lower_bound_L [L]."""
    return load_report(even_gpu_loads(placement, load_LE), lower_bound_L)


def proven_bound(load_LE: np.ndarray, count_LE: np.ndarray, num_gpus: int,
                 num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """`lower_bound` on the layers whose replica counts count_LE [L, E] (sum P per layer, each
    >= 1) are proven min-max optimal, and which layers those are: (bound [L], proven bool [L]);
    the other layers' entries are not the bound (solve them).

    The proof: expert e needs n_e = the fewest replicas with load_e / n_e below top, the
    largest load per replica under count_LE (as floats: rounded division is monotone in n);
    when the n_e sum to more than P, no counts of sum P put every expert below top, so top is
    the optimum. Layers whose top is 0 are optimal too."""
    top_L = (load_LE / count_LE).max(axis=1)
    bound_L = np.maximum(load_LE.sum(axis=1) / num_gpus, top_L)
    top_LE = top_L[:, None]
    live_LE = top_LE > 0
    n_LE = np.floor(load_LE / np.where(live_LE, top_LE, 1.0)) + 1.0
    for _ in range(4):  # the float quotient is within an ulp: n moves by one at most, once
        up = (load_LE / n_LE >= top_LE) & live_LE
        down = (n_LE > 1) & (load_LE / np.maximum(n_LE - 1, 1) < top_LE)
        if not (up.any() or down.any()):
            return bound_L, (n_LE.sum(axis=1) > num_slots) | (top_L <= 0)
        n_LE += up
        n_LE -= down
    return bound_L, top_L <= 0  # not settled (never seen): prove nothing, solve those layers
