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

from eplb.core.topology import Topology
from eplb.errors import EplbError, fraction, positive_number, whole_number
from eplb.stats.loads import replica_counts_minmax
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


def pack_vector(share_TLE: np.ndarray, count_LE: np.ndarray, topology: Topology) -> np.ndarray:
    """Place replicas on the GPUs of `topology` against all windows at once; returns phy2log_LP.

    S rounds; round k gives each GPU one of the next G heaviest replicas (heaviest = largest
    per-window load under an even split). The pairing in a round is an assignment problem
    (scipy's linear_sum_assignment): cost of replica i on GPU g = max over windows of (GPU g's
    load + replica i's load), the GPU's new worst-window load; pairing with a GPU that already
    holds the expert is forbidden. Round k can meet an expert only if its replicas straddle
    rounds k-1 and k (an expert has <= G replicas), so a feasible pairing always exists. With
    one window the cost separates (GPU load + replica load), so every feasible pairing has the
    same total and the assignment solver's worst case (O(G^3) a round) buys nothing: a round
    pairs the replicas with the GPUs in a seeded random order (`one_window_orders`), skipping a
    GPU that holds the expert. That never gets stuck: an expert's replicas are consecutive and
    at most G, so only the round's first expert can be on a GPU already (r of its replicas in
    the round before, at most G - r in this one), it is paired first, and every later expert is
    new to all GPUs. (Pairing heaviest with lightest, LPT's rule, packs tighter but leaves the
    swap search in worse local optima; scipy's pick among the tied pairings is decided by
    rounding, in effect arbitrary, and a random one refines as well: docs/backtests.md.)
    """
    from scipy.optimize import linear_sum_assignment

    T, L, E = share_TLE.shape
    G, S, P = topology.num_gpus, topology.slots_per_gpu, topology.num_slots
    w_TLE = share_TLE / count_LE[None]                         # per-replica load, even split
    key_LE = w_TLE.max(axis=0) + 1e-12 * w_TLE.sum(axis=0)     # heaviest window first, then total
    order_LE = np.argsort(-key_LE, axis=1, kind="stable")
    rep_LP = np.repeat(order_LE.ravel(), np.take_along_axis(count_LE, order_LE, 1).ravel()).reshape(L, P)
    w_LET = np.moveaxis(w_TLE, 0, 2)
    if T == 1:
        return _pack_one_window(rep_LP, one_window_orders(L, S, G), topology)
    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    load_LGT = np.zeros((L, G, T))
    holds_LGE = np.zeros((L, G, E), dtype=bool)
    rows_L1 = np.arange(L)[:, None]
    gpu_LI = np.empty((L, G), dtype=np.int64)
    for k in range(S):
        # Every layer's costs at once; the assignments, one per layer, are scipy's.
        items_LI = rep_LP[:, k * G:(k + 1) * G]
        w_LIT = w_LET[rows_L1, items_LI]                                                # [L, I, T]
        cost_LIG = load_LGT[:, None, :, 0] + w_LIT[:, :, None, 0]                       # worst window after:
        for t in range(1, T):                                                           # a loop over T beats
            np.maximum(cost_LIG, load_LGT[:, None, :, t] + w_LIT[:, :, None, t], out=cost_LIG)  # .max(axis=3)
        cost_LIG[holds_LGE[rows_L1, :, items_LI]] = _FORBIDDEN
        for l in range(L):
            gpu_LI[l] = linear_sum_assignment(cost_LIG[l])[1]            # rows come back as 0 .. I - 1
        assert np.take_along_axis(cost_LIG, gpu_LI[:, :, None], axis=2).max() < _FORBIDDEN, \
            "packing round had no feasible pairing"
        phy2log_LGS[rows_L1, gpu_LI, k] = items_LI
        load_LGT[rows_L1, gpu_LI] += w_LIT
        holds_LGE[rows_L1, gpu_LI, items_LI] = True
    return phy2log_LGS.reshape(L, P)


def one_window_orders(L: int, S: int, G: int) -> np.ndarray:
    """The GPU order of each one-window packing round, int64 [L, S, G]: a permutation of the
    GPUs drawn from a fixed seed (the same plan every run)."""
    return np.random.default_rng(0).permuted(np.broadcast_to(np.arange(G, dtype=np.int64), (L, S, G)), axis=2)


def _pack_one_window(rep_LP: np.ndarray, order_LSG: np.ndarray, topology: Topology) -> np.ndarray:
    """The one-window packing rounds, every layer in lock-step: in round k the items
    rep_LP[:, kG:(k + 1)G] each take, in turn, the first GPU of order_LSG[:, k] still free in
    the round that does not hold their expert (which packing order guarantees: `pack_vector`);
    returns phy2log_LP."""
    L, P = rep_LP.shape
    G, S = topology.num_gpus, topology.slots_per_gpu
    E = int(rep_LP.max()) + 1
    rows_L = np.arange(L)
    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    holds_LGE = np.zeros((L, G, E), dtype=bool)
    for k in range(S):
        order_LG = order_LSG[:, k]
        free_LG = np.ones((L, G), dtype=bool)                  # by position in the round's order
        for i in range(G):
            e_L = rep_LP[:, k * G + i]
            fits_LG = free_LG & ~holds_LGE[rows_L[:, None], order_LG, e_L[:, None]]
            at_L = fits_LG.argmax(axis=1)
            assert fits_LG[rows_L, at_L].all(), "packing round had no feasible pairing"
            gpu_L = order_LG[rows_L, at_L]
            free_LG[rows_L, at_L] = False
            phy2log_LGS[rows_L, gpu_L, k] = e_L
            holds_LGE[rows_L, gpu_L, e_L] = True
    return phy2log_LGS.reshape(L, P)


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
                 beta: float, quantile: float, max_rounds: int, top_gpus: int = 2) -> np.ndarray:
    """Swap replicas between a busiest GPU and any other GPU while the smooth maximum of GPU
    loads over the kept windows drops (in place; returns phy2log_LP). Each replica carries
    1 / count of its expert's share (an even split)."""
    w_LET = np.moveaxis(share_TLE / count_LE[None], 0, 2)
    slot_load_LPT = np.take_along_axis(w_LET, phy2log_LP[:, :, None], axis=1)
    smooth_max_swaps(phy2log_LP, slot_load_LPT, num_gpus, beta=beta, quantile=quantile, max_rounds=max_rounds,
                     top_gpus=top_gpus)
    return phy2log_LP


def _kept_count(quantile: float, T: int) -> int:
    """How many of T windows the objective keeps (the lowest peaks): ceil(quantile x T)."""
    return int(np.ceil(quantile * T - 1e-9))  # 0.55 x 100 is 55.00000000000001 in floating point


def smooth_max_swaps(phy2log_LP: np.ndarray, slot_load_LPT: np.ndarray, num_gpus: int, *, beta: float,
                     max_rounds: int, quantile: float = 1.0, top_gpus: int = 2, num_units: int = 1,
                     bound_LP: np.ndarray | None = None) -> None:
    """Swap slots between a busiest GPU and any other GPU while the smooth maximum of GPU
    loads over the kept windows drops; in place on phy2log_LP, slot_load_LPT (the load each
    slot carries in each window, which travels with its replica) and bound_LP. All layers
    move in lock-step; a layer stops when no swap helps it.

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
    gpu_G = np.arange(G)
    unit_G = gpu_G // (G // num_units)
    # exp(beta w) of every slot's load travels with its replica, so it is computed once.
    # Clipped exponents only matter for replicas above ~12x the mean GPU load at beta 50.
    v_LPT = np.exp(np.minimum(beta * slot_load_LPT, 600.0))
    moved = (phy2log_LP, slot_load_LPT, v_LPT) + (() if bound_LP is None else (bound_LP,))
    # Which GPUs hold each expert, kept up to date on each swap; GPUs last, so that the GPUs
    # of one expert are one row.
    holds_LEG = np.zeros((L, E, G), dtype=bool)
    holds_LEG[np.arange(L)[:, None], phy2log_LP, np.arange(P) // S] = True
    load_LGT = _gpu_loads(slot_load_LPT, G)                      # rows of swapped GPUs redone
    active = np.arange(L)
    every = _kept_count(quantile, T) >= T                       # no window left out
    for _ in range(max_rounds):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        if A == L:  # every layer still searching: read the arrays themselves, not copies
            phy2log_AP, v_APT, load_AGT = phy2log_LP, v_LPT, load_LGT
        else:
            phy2log_AP, v_APT, load_AGT = phy2log_LP[active], v_LPT[active], load_LGT[active]
        if every:
            gpu_peak_AG = _max_last(load_AGT)
        else:
            keep_A1T = kept_windows(load_AGT, quantile)[:, None, :]
            gpu_peak_AG = _max_last(np.where(keep_A1T, load_AGT, -np.inf))
        peak_A = gpu_peak_AG.max(axis=1)
        # Candidate GPUs to unload: the top_gpus GPUs by their worst kept-window load.
        src_AK = _first_largest(gpu_peak_AG, top_gpus)
        K = src_AK.shape[1]
        a_slot_AQ = (src_AK[:, :, None] * S + np.arange(S)).reshape(A, K * S)           # Q = K x S
        # Gain of swap (a, b) = sum over kept windows of ea + eb - ea' - eb', where
        # ea = exp(beta (la - m)) and ea' = ea exp(-beta (wa - wb)), eb' = eb exp(beta (wa - wb)).
        # The exponentials of wa and wb factor apart, so the sum over windows of all
        # Q x P swaps is two batched matrix products instead of a [Q, P, T] tensor. The
        # exponentials of the loads are a GPU's, shared by its slots: [A, G, T].
        e_AGT = np.exp(beta * (load_AGT - peak_A[:, None, None]))
        if not every:
            e_AGT = np.where(keep_A1T, e_AGT, 0.0)
        sum_AG = e_AGT.sum(axis=2)
        ua_AQT = v_APT[ar[:, None], a_slot_AQ]
        x_AQT = np.repeat(e_AGT[ar[:, None], src_AK], S, axis=1) / ua_AQT                # ea / ua
        y_APT = (e_AGT[:, :, None, :] / v_APT.reshape(A, G, S, T)).reshape(A, P, T)     # eb / vb
        base_AKP, bad_AKSG = _allowed_sums(sum_AG, phy2log_AP, holds_LEG, active, src_AK, a_slot_AQ, unit_G,
                                           None if bound_LP is None else bound_LP[active])
        flat, best = _best_swaps(base_AKP, bad_AKSG, x_AQT, ua_AQT, v_APT, y_APT)
        improve = best > 1e-9 * e_AGT.sum(axis=(1, 2))
        if not improve.any():
            break
        q, b = np.divmod(flat[improve], P)
        layers = active[improve]
        a = a_slot_AQ[ar[improve], q]
        ea, eb, ga, gb = phy2log_LP[layers, a], phy2log_LP[layers, b], a // S, b // S
        holds_LEG[layers, ea, ga] = holds_LEG[layers, eb, gb] = False
        holds_LEG[layers, eb, ga] = holds_LEG[layers, ea, gb] = True
        for arr in moved:
            tmp = arr[layers, a].copy()
            arr[layers, a] = arr[layers, b]
            arr[layers, b] = tmp
        for g in (ga, gb):
            load_LGT[layers, g] = _gpu_loads(slot_load_LPT[layers[:, None], g[:, None] * S + np.arange(S)], 1)[:, 0]
        active = layers


def _allowed_sums(sum_AG, phy2log_AP, holds_LEG, active, src_AK, a_slot_AQ, unit_G, bound_AP):
    """Where the gain of a swap (a, b) starts, and which swaps are forbidden. base_AKP [A, K, P]:
    the sum of exponentials of a's GPU (source k) plus that of b's GPU, -inf where b sits on A's
    GPU, e_b is already on A's GPU or a bound b would leave its unit; bad_AKSG [A, K, S_a, G_b]:
    e_a already on B's GPU (the same expert included) or a bound a would leave its unit."""
    A, K = src_AK.shape
    P = phy2log_AP.shape[1]
    G = unit_G.shape[0]
    S = P // G
    ar = np.arange(A)
    base_AKGS = np.repeat((sum_AG[ar[:, None], src_AK][:, :, None] + sum_AG[:, None, :])[:, :, :, None], S, axis=3)
    base_AKGS[ar[:, None], np.arange(K), src_AK, :] = -np.inf
    base_AKP = base_AKGS.reshape(A, K, P)
    base_AKP[holds_LEG[active[:, None, None], phy2log_AP[:, None, :], src_AK[:, :, None]]] = -np.inf
    ea_AKS = phy2log_AP[ar[:, None], a_slot_AQ].reshape(A, K, S)
    bad_AKSG = holds_LEG[active[:, None, None], ea_AKS]
    if bound_AP is not None:
        ba_AKS = np.take_along_axis(bound_AP, a_slot_AQ, axis=1).reshape(A, K, S)
        other_AKG = unit_G != unit_G[src_AK][:, :, None]
        bad_AKSG |= ba_AKS[:, :, :, None] & other_AKG[:, :, None, :]
        base_AKGS[bound_AP.reshape(A, 1, G, S) & other_AKG[:, :, :, None]] = -np.inf
    return base_AKP, bad_AKSG


_CHUNK = 1 << 16
"""Gains scored at a time, about: a few layers' [Q, P] gains, so that the gains and the product
they subtract stay in the core's cache (the whole [A, Q, P] is megabytes)."""


def _best_swaps(base_AKP, bad_AKSG, x_AQT, ua_AQT, v_APT, y_APT) -> tuple[np.ndarray, np.ndarray]:
    """Index (q P + b) and gain of the best swap of each layer, int [A] and float [A], a few
    layers at a time: gain = base - sum_t x_qt v_bt - sum_t ua_qt y_bt over the Q = K x S source
    slots and all P slots, subtracted in that order; -inf where base is or bad_AKSG says so."""
    A, K, S, G = bad_AKSG.shape
    P, T, Q = base_AKP.shape[2], v_APT.shape[2], K * S
    step = max(1, _CHUNK // (Q * P))
    gain_BQP, prod_BQP = np.empty((min(step, A), Q, P)), np.empty((min(step, A), Q, P))
    flat_A, best_A = np.empty(A, dtype=np.int64), np.empty(A)
    for c in range(0, A, step):
        n = min(step, A - c)
        gain, prod = gain_BQP[:n], prod_BQP[:n]
        if T == 1:  # a product of one term each: the matrix products' own values
            np.multiply(x_AQT[c:c + n], v_APT[c:c + n, None, :, 0], out=gain)
            np.multiply(ua_AQT[c:c + n], y_APT[c:c + n, None, :, 0], out=prod)
        else:
            np.matmul(x_AQT[c:c + n], np.swapaxes(v_APT[c:c + n], 1, 2), out=gain)
            np.matmul(ua_AQT[c:c + n], np.swapaxes(y_APT[c:c + n], 1, 2), out=prod)
        gain_BKSP = gain.reshape(n, K, S, P)
        np.subtract(base_AKP[c:c + n, :, None, :], gain_BKSP, out=gain_BKSP)
        gain -= prod
        # e_a on B's GPU is rare (a few GPUs per source slot): set those rows of S_b only.
        gain.reshape(n, K, S, G, S)[np.nonzero(bad_AKSG[c:c + n])] = -np.inf
        flat_A[c:c + n] = gain.reshape(n, -1).argmax(axis=1)
        best_A[c:c + n] = gain.reshape(n, -1)[np.arange(n), flat_A[c:c + n]]
    return flat_A, best_A


def _max_last(x_ABT: np.ndarray) -> np.ndarray:
    """x_ABT.max(axis=2), [A, B]: a loop over the few windows, several times faster than numpy's
    reduction over a short last axis (and a maximum is exact in any order)."""
    out_AB = x_ABT[:, :, 0].copy()
    for t in range(1, x_ABT.shape[2]):
        np.maximum(out_AB, x_ABT[:, :, t], out=out_AB)
    return out_AB


def _gpu_loads(slot_load_LPT: np.ndarray, num_gpus: int) -> np.ndarray:
    """Load of every GPU in every window, [L, G, T]: its slots' loads added in slot order."""
    L, P, T = slot_load_LPT.shape
    return slot_load_LPT.reshape(L, num_gpus, P // num_gpus, T).sum(axis=2)


def _first_largest(x_AG: np.ndarray, k: int) -> np.ndarray:
    """Columns of the k largest entries of each row, largest first (ties: lower column first),
    int [A, min(k, G)]: np.argsort(-x_AG, kind="stable")[:, :k] for a small k."""
    x_AG = x_AG.copy()
    rows_A = np.arange(x_AG.shape[0])
    out_AK = np.empty((x_AG.shape[0], min(k, x_AG.shape[1])), dtype=np.int64)
    for j in range(out_AK.shape[1]):
        out_AK[:, j] = x_AG.argmax(axis=1)
        x_AG[rows_A, out_AK[:, j]] = -np.inf
    return out_AK


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
        for blend in self.blends:
            count_LE = replica_counts_minmax(robust_demand(share_TLE, blend), P, max_replicas=G)
            # Blends that give the same replica counts give the same plan (one window: the mean
            # share is the max), so it is packed and refined once.
            if any(np.array_equal(count_LE, c) for c in tried):
                continue
            tried.append(count_LE)
            phy2log_LP = pack_vector(share_TLE, count_LE, topo)
            if self.refine_rounds:
                refine_swaps(phy2log_LP, share_TLE, count_LE, G, beta=self.beta, quantile=self.quantile,
                             max_rounds=self.refine_rounds)
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
        }
        return Solution(best_phy2log_LP, message=f"balanced against {T} window(s)", info=info)

    def _score(self, phy2log_LP, share_TLE, count_LE, num_gpus) -> np.ndarray:
        """The objective per layer: the worst busiest/mean GPU over the windows the swap search
        keeps (`kept_windows`: the ceil(quantile x T) lowest peaks), [L]."""
        load_LGT = window_gpu_loads(phy2log_LP, share_TLE, count_LE, num_gpus)
        keep_LT = kept_windows(load_LGT, self.quantile)
        return np.where(keep_LT, load_LGT.max(axis=1), -np.inf).max(axis=1)
