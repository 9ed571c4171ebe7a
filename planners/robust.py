"""Robust planning from history: balance every window of the history, not just their sum.

Legend: T = history windows, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S physical slots, I = replicas handed out in one packing round (= G).

A plan made on the sum of past windows is balanced for the average past, but traffic moves
between regimes (prefill vs decode, chat vs code): the expert that is hot in one regime is
cold in another. This planner treats the history as T separate load vectors and keeps the
busiest GPU low in *each* of them, so an expert that is hot in any recent regime gets
replicas, and replicas of hot experts land on GPUs that are light when that expert is hot
(which is also what leaves room for a dynamic per-batch re-split to move tokens).

Step 0: normalise. Each window and layer is scaled so that the mean GPU load is 1; big and
        small windows count the same and scores read as max/mean directly.
Step 1: replicate. Replica counts minimise the largest load per replica of a demand that
        blends the windows' mean and max share of each expert (`blend`: 0 = mean, 1 = max).
Step 2: pack (vector LPT). Replicas, heaviest first (by their largest per-window load), are
        handed out in S rounds of G; in each round an assignment (scipy's
        linear_sum_assignment) gives every GPU one replica so as to minimise the sum over GPUs
        of the GPU's worst-window load after the round, never two replicas of one expert on
        one GPU.
Step 3: refine. Pairwise replica swaps between a busiest GPU and any other GPU, accepted while
        they lower a smooth maximum (log-sum-exp, sharpness `beta`) of the GPU loads over all
        (kept) windows; exact gains are computed for every candidate swap at once.
Steps 1-3 run for each blend in `blends`, and the plan with the lowest worst-window maximum
on the history is kept per layer. With `quantile` < 1 the worst windows (above that quantile
of the per-window maximum) are left out of the objective, so a single outlier window does not
drive the plan. All layers move in lock-step (numpy over L); each blend costs one packing and
one swap search (benchmarks/bench_backtest.py times them).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import CachedKernels, kernel_array
from eplb.errors import EplbError, fraction, positive_number, whole_number
from eplb.stats.loads import replica_counts_minmax
from planners._threads import run_blocks
from planners.api import PlanRequest, Solution

_FORBIDDEN = 1e9  # assignment cost of an infeasible (expert already on this GPU) pairing


def normalise_windows(history_TLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Scale each window and layer so the mean GPU load is 1, float64 [T, L, E].

    Windows (or layers) with no tokens stay all-zero: they constrain nothing.
    """
    h = np.asarray(history_TLE, dtype=np.float64)
    total_TL1 = h.sum(axis=2, keepdims=True)
    return np.where(total_TL1 > 0, h * num_gpus / np.where(total_TL1 > 0, total_TL1, 1.0), 0.0)


def robust_demand(share_TLE: np.ndarray, blend: float) -> np.ndarray:
    """Demand per expert for replica counting, [L, E]: mean share + blend x (max - mean)."""
    mean_LE = share_TLE.mean(axis=0)
    return mean_LE + blend * (share_TLE.max(axis=0) - mean_LE)


def pack_vector(share_TLE: np.ndarray, count_LE: np.ndarray, num_gpus: int, slots_per_gpu: int,
                compiled: bool | None = None) -> np.ndarray:
    """Place replicas on GPUs against all windows at once; returns phy2log_LP.

    S rounds; round k gives each GPU one of the next G heaviest replicas (heaviest = largest
    per-window load under an even split). The pairing in a round is an assignment problem:
    cost of replica i on GPU g = max over windows of (GPU g's load + replica i's load), the
    GPU's new worst-window load; pairing with a GPU that already holds the expert is
    forbidden. Round k can meet an expert only if its replicas straddle rounds k-1 and k
    (an expert has <= G replicas), so a feasible pairing always exists. With one window the
    cost separates (GPU load + replica load), so every feasible pairing has the same total and
    the assignment solver's worst case (O(G^3) a round) buys nothing: a round pairs the
    replicas with the GPUs in a seeded random order (`one_window_orders`), skipping a GPU
    that holds the expert. That never gets stuck: an expert's replicas are consecutive and at
    most G, so only the round's first expert can be on a GPU already (r of its replicas in the
    round before, at most G - r in this one), it is paired first, and every later expert is
    new to all GPUs. (Pairing heaviest with lightest, LPT's rule, packs tighter but leaves the
    swap search in worse local optima; scipy's pick among the tied pairings is decided by
    rounding, in effect arbitrary, and a random one refines as well: docs/backtests.md.)
    compiled: as in `smooth_max_swaps` (the kernel's assignment is scipy's
    linear_sum_assignment, tie rules included; False: numpy and scipy).
    """
    T, L, E = share_TLE.shape
    G, S = num_gpus, slots_per_gpu
    P = G * S
    w_TLE = share_TLE / count_LE[None]                         # per-replica load, even split
    key_LE = w_TLE.max(axis=0) + 1e-12 * w_TLE.sum(axis=0)     # heaviest window first, then total
    order_LE = np.argsort(-key_LE, axis=1, kind="stable")
    rep_LP = np.repeat(order_LE.ravel(), np.take_along_axis(count_LE, order_LE, 1).ravel()).reshape(L, P)
    w_LET = np.moveaxis(w_TLE, 0, 2)
    order_LSG = one_window_orders(L, S, G) if T == 1 else np.zeros((L, S, G), dtype=np.int64)
    kernels = robust_kernels(wait=True) if compiled else (robust_kernels() if compiled is None else None)
    if kernels is not None:
        w_LET = np.ascontiguousarray(w_LET)
        phy2log_LP = np.empty((L, P), dtype=np.int64)
        feasible: list[bool] = []

        def pack_block(a: int, b: int) -> None:
            # Layers pack independently: blocks of them on the planners' threads (the kernel
            # releases the GIL); a layer's cells are its slots x windows.
            phy2log_LP[a:b], ok = kernels.pack_vector(w_LET[a:b], rep_LP[a:b], order_LSG[a:b], G, S, _FORBIDDEN)
            feasible.append(ok)

        run_blocks(pack_block, L, P * T)
        assert all(feasible), "packing round had no feasible pairing"
        return phy2log_LP
    from scipy.optimize import linear_sum_assignment

    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    load_LGT = np.zeros((L, G, T))
    holds_LGE = np.zeros((L, G, E), dtype=bool)
    for l in range(L):
        for k in range(S):
            items_I = rep_LP[l, k * G:(k + 1) * G]
            w_IT = w_LET[l, items_I]                                            # [I, T]
            rows_I = np.arange(G)
            if T == 1:
                gpu_I = _assign_in_order(order_LSG[l, k], items_I, holds_LGE[l])
                assert gpu_I is not None, "packing round had no feasible pairing"
            else:
                cost_IG = (load_LGT[l][None, :, :] + w_IT[:, None, :]).max(axis=2)  # worst window after
                cost_IG = np.where(holds_LGE[l][:, items_I].T, _FORBIDDEN, cost_IG)
                rows_I, gpu_I = linear_sum_assignment(cost_IG)
                assert cost_IG[rows_I, gpu_I].max() < _FORBIDDEN, "packing round had no feasible pairing"
            phy2log_LGS[l, gpu_I, k] = items_I[rows_I]
            load_LGT[l, gpu_I] += w_IT[rows_I]
            holds_LGE[l, gpu_I, items_I[rows_I]] = True
    return phy2log_LGS.reshape(L, P)


def one_window_orders(L: int, S: int, G: int) -> np.ndarray:
    """The GPU order of each one-window packing round, int64 [L, S, G]: a permutation of the
    GPUs drawn from a fixed seed (the same plan every run). C-ordered: the packing kernel's one
    compiled signature (the warm-up's) takes C-ordered arrays; numpy's permuted returns strides."""
    orders_LSG = np.random.default_rng(0).permuted(np.broadcast_to(np.arange(G, dtype=np.int64), (L, S, G)), axis=2)
    return np.ascontiguousarray(orders_LSG)


def _assign_in_order(order_G: np.ndarray, items_I: np.ndarray, holds_GE: np.ndarray) -> np.ndarray | None:
    """One window's packing round: the items each take the first GPU of order_G left that does
    not hold their expert; the GPU of each item, or None when an item finds none left (which
    packing order rules out: `pack_vector`)."""
    free_G = np.ones(order_G.shape[0], dtype=bool)
    gpu_I = np.empty(items_I.shape[0], dtype=np.int64)
    for i, e in enumerate(items_I):
        fits = order_G[free_G[order_G] & ~holds_GE[order_G, e]]
        if fits.size == 0:
            return None
        gpu_I[i] = fits[0]
        free_G[fits[0]] = False
    return gpu_I


def window_gpu_loads(phy2log_LP: np.ndarray, share_TLE: np.ndarray, count_LE: np.ndarray, num_gpus: int) -> np.ndarray:
    """GPU loads of every window under an even split, [L, G, T]."""
    T, L, E = share_TLE.shape
    P = phy2log_LP.shape[1]
    w_LET = np.moveaxis(share_TLE / count_LE[None], 0, 2)
    w_LPT = np.take_along_axis(w_LET, phy2log_LP[:, :, None], axis=1)
    return w_LPT.reshape(L, num_gpus, P // num_gpus, T).sum(axis=2)


def kept_windows(load_LGT: np.ndarray, quantile: float) -> np.ndarray:
    """Mask [L, T] of the windows the objective looks at: those at or below the quantile of
    the per-window maximum (all windows when quantile is 1)."""
    peak_LT = load_LGT.max(axis=1)
    T = peak_LT.shape[1]
    keep = _kept_count(quantile, T)
    if keep >= T:
        return np.ones_like(peak_LT, dtype=bool)
    rank_LT = np.argsort(np.argsort(peak_LT, axis=1, kind="stable"), axis=1, kind="stable")
    return rank_LT < keep


def refine_swaps(phy2log_LP: np.ndarray, share_TLE: np.ndarray, count_LE: np.ndarray, num_gpus: int, *,
                 beta: float, quantile: float, max_rounds: int, top_gpus: int = 2,
                 compiled: bool | None = None) -> np.ndarray:
    """Swap replicas between a busiest GPU and any other GPU while the smooth maximum of GPU
    loads over the kept windows drops (in place; returns phy2log_LP). Each replica carries
    1 / count of its expert's share (an even split); compiled: see `smooth_max_swaps`."""
    w_LET = np.moveaxis(share_TLE / count_LE[None], 0, 2)
    slot_load_LPT = np.take_along_axis(w_LET, phy2log_LP[:, :, None], axis=1)
    smooth_max_swaps(phy2log_LP, slot_load_LPT, num_gpus, beta=beta, quantile=quantile, max_rounds=max_rounds,
                     top_gpus=top_gpus, compiled=compiled)
    return phy2log_LP


def smooth_max_swaps(phy2log_LP: np.ndarray, slot_load_LPT: np.ndarray, num_gpus: int, *, beta: float,
                     max_rounds: int, quantile: float = 1.0, top_gpus: int = 2, num_units: int = 1,
                     bound_LP: np.ndarray | None = None, compiled: bool | None = None) -> bool:
    """Swap slots between a busiest GPU and any other GPU while the smooth maximum of GPU
    loads over the kept windows drops; in place on phy2log_LP, slot_load_LPT (the load each
    slot carries in each window, which travels with its replica) and bound_LP.

    The search is `smooth_max_swaps_numpy` (its docstring specifies it), run by its compiled
    kernel (planners/_robust_kernel.py; tests hold the two to the same placements). compiled:
    None uses the kernel when numba's cache has it and otherwise searches in numpy while the
    kernel compiles in a background process for later runs (`robust_kernels`); True compiles here
    if need be; False is numpy. Returns whether the kernel ran.
    """
    kernels = robust_kernels(wait=True) if compiled else (robust_kernels() if compiled is None else None)
    if kernels is None:
        smooth_max_swaps_numpy(phy2log_LP, slot_load_LPT, num_gpus, beta=beta, max_rounds=max_rounds,
                               quantile=quantile, top_gpus=top_gpus, num_units=num_units, bound_LP=bound_LP)
        return False
    L, P, T = slot_load_LPT.shape
    phy = kernel_array(phy2log_LP, np.int64)
    w = kernel_array(slot_load_LPT, np.float64)
    bound = np.zeros((L, P), dtype=np.bool_) if bound_LP is None else kernel_array(bound_LP, np.bool_)
    args = (int(num_gpus), float(beta), int(max_rounds), _kept_count(quantile, T), int(top_gpus),
            int(num_gpus) // int(num_units))
    # Layers are independent and the kernel releases the GIL: blocks of layers (C-ordered views,
    # searched in place) run on the planners' kept threads; a layer's cells are its slots x windows.
    run_blocks(lambda a, b: kernels.smooth_max_swaps(phy[a:b], w[a:b], bound[a:b], *args), L, P * T)
    for dst, src in ((phy2log_LP, phy), (slot_load_LPT, w), (bound_LP, bound)):
        if dst is not None and dst is not src:
            dst[...] = src
    return True


_KERNELS = CachedKernels("planners._robust_kernel")


def robust_kernels(wait: bool = False):
    """The compiled packing and swap search (the module planners._robust_kernel), or None while
    they are not compiled yet.

    A process loads them from numba's cache once (a fraction of a second). On a cold cache (the
    first run after an install) this starts one background process that compiles them into the
    cache (10-30 s on a small machine) and returns None: the planner meanwhile runs in numpy
    and scipy, with the same result, and says so in its message. wait=True compiles here instead.
    """
    return _KERNELS.get(wait)


def _kept_count(quantile: float, T: int) -> int:
    """How many of T windows the objective keeps (the lowest peaks): ceil(quantile x T)."""
    return int(np.ceil(quantile * T - 1e-9))  # 0.55 x 100 is 55.00000000000001 in floating point


def warm_up() -> None:
    """Load (or, on a fresh install, compile) the robust kernels now (eplb.core.jit runs this in
    the background for a Rebalancer that plans with robust)."""
    robust_kernels(wait=True)


def smooth_max_swaps_numpy(phy2log_LP: np.ndarray, slot_load_LPT: np.ndarray, num_gpus: int, *, beta: float,
                           max_rounds: int, quantile: float = 1.0, top_gpus: int = 2, num_units: int = 1,
                           bound_LP: np.ndarray | None = None) -> None:
    """`smooth_max_swaps` in numpy, all layers in lock-step: the specification of the search.

    Objective per layer: Z = sum over kept windows t and GPUs g of exp(beta (load_gt - m)),
    m the layer's current peak. A swap of slot a (GPU A) with slot b (GPU B) changes only A's
    and B's loads, so its exact change of Z is a sum over windows of four exponentials.
    Unlike the hard maximum, Z also rewards lowering the second-busiest (window, GPU) pair,
    which keeps the search moving across ties between windows. A swap never puts two replicas
    of one expert on one GPU; a bound slot (bound_LP) stays inside its unit of
    num_gpus / num_units consecutive GPUs.
    """
    L, P, T = slot_load_LPT.shape
    G = num_gpus
    S = P // G
    E = int(phy2log_LP.max()) + 1
    gpu_of_P = np.arange(P) // S
    unit_of_P = gpu_of_P // (G // num_units)
    active = np.arange(L)
    for _ in range(max_rounds):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        phy2log_AP = phy2log_LP[active]
        w_APT = slot_load_LPT[active]
        load_AGT = w_APT.reshape(A, G, S, T).sum(axis=2)
        keep_AT = kept_windows(load_AGT, quantile)
        peak_A = np.where(keep_AT[:, None, :], load_AGT, -np.inf).max(axis=(1, 2))
        # Candidate GPUs to unload: the top_gpus GPUs by their worst kept-window load.
        gpu_peak_AG = np.where(keep_AT[:, None, :], load_AGT, -np.inf).max(axis=2)
        src_AK = np.argsort(-gpu_peak_AG, axis=1, kind="stable")[:, :top_gpus]          # [A, K]
        K = src_AK.shape[1]
        a_slot_AQ = (src_AK[:, :, None] * S + np.arange(S)).reshape(A, K * S)           # Q = K x S
        wa_AQT = np.take_along_axis(w_APT, a_slot_AQ[:, :, None], axis=1)
        ea_AQ = np.take_along_axis(phy2log_AP, a_slot_AQ, axis=1)
        gpu_a_AQ = a_slot_AQ // S
        la_AQT = np.take_along_axis(load_AGT, gpu_a_AQ[:, :, None], axis=1)
        lb_APT = load_AGT[:, gpu_of_P]                                                   # [A, P, T]
        # Gain of swap (a, b) = sum over kept windows of ea + eb - ea' - eb', where
        # ea = exp(beta (la - m)) and ea' = ea exp(-beta (wa - wb)), eb' = eb exp(beta (wa - wb)).
        # The exponentials of wa and wb factor apart, so the sum over windows of all
        # Q x P swaps is two batched matrix products instead of a [Q, P, T] tensor.
        m_A11 = peak_A[:, None, None]
        keep_A1T = keep_AT[:, None, :]
        ea_AQT = np.where(keep_A1T, np.exp(beta * (la_AQT - m_A11)), 0.0)
        eb_APT = np.where(keep_A1T, np.exp(beta * (lb_APT - m_A11)), 0.0)
        # Clipped exponents only matter for replicas above ~12x the mean GPU load at beta 50.
        ua_AQT = np.exp(np.minimum(beta * wa_AQT, 600.0))
        vb_APT = np.exp(np.minimum(beta * w_APT, 600.0))
        gain_AQP = (ea_AQT.sum(axis=2)[:, :, None] + eb_APT.sum(axis=2)[:, None, :]
                    - np.matmul(ea_AQT / ua_AQT, np.swapaxes(vb_APT, 1, 2))
                    - np.matmul(ua_AQT, np.swapaxes(eb_APT / vb_APT, 1, 2)))
        # Forbidden: b on A's GPU; the same expert; e_b already on A's GPU; e_a already on B's GPU.
        holds_AGE = np.zeros((A, G, E), dtype=bool)
        holds_AGE[ar[:, None], gpu_of_P[None, :], phy2log_AP] = True
        eb_on_a_AQP = holds_AGE[ar[:, None, None], gpu_a_AQ[:, :, None], phy2log_AP[:, None, :]]
        ea_on_b_AQP = holds_AGE[ar[:, None, None], gpu_of_P[None, None, :], ea_AQ[:, :, None]]
        bad = ((gpu_of_P[None, None, :] == gpu_a_AQ[:, :, None]) | eb_on_a_AQP | ea_on_b_AQP)
        if bound_LP is not None:
            bnd_AP = bound_LP[active]
            ba_AQ = np.take_along_axis(bnd_AP, a_slot_AQ, axis=1)
            same_unit = unit_of_P[None, None, :] == unit_of_P[a_slot_AQ][:, :, None]
            bad |= ~((~ba_AQ[:, :, None] & ~bnd_AP[:, None, :]) | same_unit)
        gain_AQP = np.where(bad, -np.inf, gain_AQP)
        flat = gain_AQP.reshape(A, -1).argmax(axis=1)
        best = gain_AQP.reshape(A, -1)[ar, flat]
        z_A = np.where(keep_AT[:, None, :], np.exp(beta * (load_AGT - peak_A[:, None, None])), 0.0).sum(axis=(1, 2))
        improve = best > 1e-9 * z_A
        if not improve.any():
            break
        q, b = np.divmod(flat[improve], P)
        layers = active[improve]
        a = a_slot_AQ[ar[improve], q]
        for arr in (phy2log_LP, slot_load_LPT) if bound_LP is None else (phy2log_LP, slot_load_LPT, bound_LP):
            tmp = arr[layers, a].copy()
            arr[layers, a] = arr[layers, b]
            arr[layers, b] = tmp
        active = layers


def parse_blends(blends: tuple | list | str | float) -> tuple[float, ...]:
    """The demand blends setting: numbers in [0, 1], as a sequence, one number, or text
    ("0,1", as `--set blends=0,1` gives it)."""
    if isinstance(blends, str):
        try:
            blends = tuple(float(b) for b in blends.replace(";", ",").split(",") if b.strip())
        except ValueError:
            raise EplbError(f"blends must be numbers in [0, 1] separated by commas, got {blends!r}") from None
    elif isinstance(blends, (int, float)):
        blends = (float(blends),)
    blends = tuple(float(b) for b in blends)
    if not blends or any(not 0.0 <= b <= 1.0 for b in blends):
        raise EplbError(f"blends must be one or more numbers in [0, 1], got {blends!r}")
    return blends


class RobustPlanner:
    """Plan against every history window: keep the worst window's busiest GPU low.

    blends: demand blends tried for replica counts (0 = mean share over windows, 1 = max);
        the best plan on the history is kept per layer.
    quantile: fraction of windows the objective covers (1 = all, the worst window counts;
        0.9 = the worst 10% of windows are treated as outliers).
    beta: sharpness of the smooth maximum in the swap search (loads are in units of the mean
        GPU load; 50 makes a GPU 2% above another count e times more).
    refine_rounds: swap rounds (0 = vector packing only).
    """

    name = "robust"

    def __init__(self, blends: tuple | list | str = (0.0, 1.0), quantile: float = 1.0,
                 beta: float = 50.0, refine_rounds: int = 200):
        self.blends = parse_blends(blends)
        # float() first: a setting given as text (--set quantile=x) is "of the wrong type" (get_planner).
        self.quantile = fraction("quantile", float(quantile))
        self.beta = positive_number("beta", float(beta))
        self.refine_rounds = whole_number("refine_rounds", refine_rounds)

    def plan(self, request: PlanRequest) -> Solution:
        topo = request.topology
        G, S = topo.num_gpus, topo.slots_per_gpu
        P = G * S
        L, E = request.load_LE.shape
        if P < E:
            raise EplbError(f"{G} GPUs x {S} slots = {P} slots cannot hold {E} experts")
        if P > G * E:
            raise EplbError(f"{P} slots need more than one replica of an expert per GPU ({E} experts, {G} GPUs)")
        history = request.history_TLE if request.history_TLE is not None else request.load_LE[None]
        history = np.asarray(history, dtype=np.float64)
        if history.ndim != 3 or history.shape[1:] != (L, E):
            raise EplbError(f"history must be [windows, {L}, {E}], got shape {history.shape}")
        share_TLE = normalise_windows(history, G)
        best_phy2log_LP = None
        best_score_L = np.full(L, np.inf)
        chosen_L = np.zeros(L)
        tried: list[np.ndarray] = []
        compiled = robust_kernels() is not None
        for blend in self.blends:
            count_LE = replica_counts_minmax(robust_demand(share_TLE, blend), P, max_replicas=G)
            # Blends that give the same replica counts give the same plan (one window: the mean
            # share is the max), so it is packed and refined once.
            if any(np.array_equal(count_LE, c) for c in tried):
                continue
            tried.append(count_LE)
            phy2log_LP = pack_vector(share_TLE, count_LE, G, S, compiled=compiled)
            if self.refine_rounds:
                refine_swaps(phy2log_LP, share_TLE, count_LE, G, beta=self.beta, quantile=self.quantile,
                             max_rounds=self.refine_rounds, compiled=compiled)
            score_L = self._score(phy2log_LP, share_TLE, count_LE, G)
            better = score_L < best_score_L - 1e-12
            if best_phy2log_LP is None:
                best_phy2log_LP = phy2log_LP.copy()
            best_phy2log_LP[better] = phy2log_LP[better]
            best_score_L = np.where(better, score_L, best_score_L)
            chosen_L = np.where(better, blend, chosen_L)
        assert best_phy2log_LP is not None
        T = history.shape[0]
        info = {
            "windows": int(T),
            "quantile": self.quantile,
            "history_peak_median": float(np.median(best_score_L)),
            "history_peak_max": float(np.max(best_score_L)),
            "blend_chosen": {str(b): int(np.sum(chosen_L == b)) for b in self.blends},
            "blends_planned": len(tried),
                    # The same plan either way; numpy only on a cold numba cache, while the kernels compile.
            "compiled": compiled,
        }
        message = f"balanced against {T} window(s)"
        if not compiled:
            message += "; packed and refined in numpy (the compiled kernels are being cached in the background)"
        return Solution(best_phy2log_LP, message=message, info=info)

    def _score(self, phy2log_LP, share_TLE, count_LE, num_gpus) -> np.ndarray:
        """The objective per layer: the worst busiest/mean GPU over the windows the swap search
        keeps (`kept_windows`: the ceil(quantile x T) lowest peaks), [L]."""
        load_LGT = window_gpu_loads(phy2log_LP, share_TLE, count_LE, num_gpus)
        keep_LT = kept_windows(load_LGT, self.quantile)
        return np.where(keep_LT, load_LGT.max(axis=1), -np.inf).max(axis=1)
