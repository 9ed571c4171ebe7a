"""Compiled steps of the adaptive policy (numba): window scores and the repair of a placement.

Legend: M = windows in memory, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S slots, B = demand blends, C = partner GPUs a swap may reach.

- `window_busiest`: busiest / mean GPU of one placement on every window, [M, L] (even split);
- `repair`: per layer, the placement in force changed a little to balance every window
  (see `eplb.serving.repair.robust_repair` for the steps), and its cost before and after; its
  swaps are `_swaps_kernel`'s.
Windows arrive as they are kept (raw counts or planning loads, any order: every step here is
a sum or a maximum over windows) and are normalised per (window, layer) inside, so the mean
GPU load is 1 and a GPU's load reads as busiest / mean directly. Layers are independent: each
is repaired on its own, one after another. Every kernel trusts its input (eplb.serving.policy checks
it) and releases the GIL (a serving thread keeps running while a side thread decides).
tests/oracles/policy.py is the plain numpy reference the tests compare the repair with, slot by
slot.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel
from eplb.serving._swaps_kernel import _TIE, _arrival, _departure, _loads, _swaps


@kernel(inline=True, error_model="numpy")
def _shares(ring_MLE, l, G, share_EM):
    """Layer l of every window scaled so the mean GPU load is 1 (idle windows stay 0)."""
    M, _, E = ring_MLE.shape
    for m in range(M):
        tot = 0.0
        for e in range(E):
            tot += ring_MLE[m, l, e]
        for e in range(E):
            share_EM[e, m] = ring_MLE[m, l, e] * G / tot if tot > 0 else 0.0


@kernel(inline=True, error_model="numpy")
def _cost(load_GM, w_M, worst_weight):
    """(the mean (windows weighted by w_M) and the worst window of the busiest GPU, weighted
    1 - worst_weight and worst_weight; the worst window's busiest)."""
    G, M = load_GM.shape
    total = 0.0
    wsum = 0.0
    worst = 0.0
    for m in range(M):
        top = 0.0
        for g in range(G):
            top = max(top, load_GM[g, m])
        total += w_M[m] * top
        wsum += w_M[m]
        worst = max(worst, top)
    return (1.0 - worst_weight) * total / wsum + worst_weight * worst, worst


@kernel(error_model="numpy")
def window_busiest(ring_MLE, phy2log_LP, num_gpus):
    """Busiest GPU of the placement on each window and layer, [M, L] (mean GPU load 1)."""
    M, L, E = ring_MLE.shape
    P = phy2log_LP.shape[1]
    S = P // num_gpus
    share_EM = np.empty((E, M))
    load_GM = np.empty((num_gpus, M))
    cnt_E = np.empty(E, dtype=np.int64)
    out_ML = np.zeros((M, L))
    for l in range(L):
        _shares(ring_MLE, l, num_gpus, share_EM)
        cnt_E[:] = 0
        for p in range(P):
            cnt_E[phy2log_LP[l, p]] += 1
        _loads(phy2log_LP[l], cnt_E, share_EM, S, load_GM)
        for m in range(M):
            top = 0.0
            for g in range(num_gpus):
                top = max(top, load_GM[g, m])
            out_ML[m, l] = top
    return out_ML


@kernel(inline=True, error_model="numpy")
def _demand(share_EM, w_M, blend, key_E):
    """Each expert's demand, blending its mean (windows weighted by w_M) and worst share (with
    `_targets`' tie-break bonus), into key_E."""
    E, M = share_EM.shape
    wsum = 0.0
    for m in range(M):
        wsum += w_M[m]
    top = 0.0
    for e in range(E):
        s = 0.0
        mx = 0.0
        for m in range(M):
            s += w_M[m] * share_EM[e, m]
            mx = max(mx, share_EM[e, m])
        mean = s / wsum
        key_E[e] = mean + blend * (mx - mean)
        top = max(top, key_E[e])
    bonus = 1e-9 * max(top, 1.0)
    for e in range(E):
        key_E[e] = key_E[e] + bonus * (E - e) / E


@kernel(inline=True, error_model="numpy")
def _targets(key_E, P, G, r_E, per_E, heap_E):
    """Replica counts for the demand key_E (`_demand`), as
    `eplb.stats.replica_counts_minmax(demand, P, max_replicas=G)` sets them (same tie-break).

    Each of the P - E extra slots goes to the expert with the highest demand per replica (the
    lowest id among equals), taken from a binary heap of the experts in that order (a scan of
    all E experts per slot would be 65,000 steps a layer at 256 GPUs). The heap keeps each
    entry's demand per replica beside its id (per_E[i] belongs to heap_E[i]): a comparison
    reads two neighbouring values, not two experts' scattered ones.
    """
    E = key_E.shape[0]
    for e in range(E):
        r_E[e] = 1
        per_E[e] = -np.inf if G <= 1 else key_E[e]
        heap_E[e] = e
    for i in range(E // 2 - 1, -1, -1):
        _sift_down(heap_E, per_E, i, heap_E[i], per_E[i])
    for _ in range(P - E):
        best = heap_E[0]
        r_E[best] += 1
        # The root's value only fell: it sinks from the top.
        _sift_down(heap_E, per_E, 0, best, -np.inf if r_E[best] >= G else key_E[best] / r_E[best])


@kernel(inline=True, error_model="numpy")
def _sift_down(heap_E, per_E, i, e, v):
    """Put expert e with demand per replica v at heap position i and let it sink below the
    entries taken before it (more demand per replica, or as much and a lower id); its
    children move up into the hole as it passes them."""
    n = heap_E.shape[0]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (per_E[c + 1] > per_E[c] or (per_E[c + 1] == per_E[c] and heap_E[c + 1] < heap_E[c])):
            c += 1
        if not (per_E[c] > v or (per_E[c] == v and heap_E[c] < e)):
            break
        heap_E[i] = heap_E[c]
        per_E[i] = per_E[c]
        i = c
    heap_E[i] = e
    per_E[i] = v


@kernel(inline=True, error_model="numpy")
def _fill(phy_P, cnt_E, target_E, share_EM, S, hold_EG, was_EG, in_G, moved, cap_total, cap_G, load_GM, peak_G):
    """Replicas from experts above their target count to experts below it, one slot at a time:
    each new replica overwrites a slot of an expert with replicas to spare, on a GPU without
    the needy expert, the GPU whose worst window is lightest (first such slot on a tie).
    Returns the moves made so far. load_GM and peak_G (each GPU's worst window) are kept up to
    date: only the GPUs holding the two experts whose replica counts change are touched."""
    E = cnt_E.shape[0]
    G, M = load_GM.shape
    capped = cap_total < np.inf or cap_G.min() < np.inf
    _loads(phy_P, cnt_E, share_EM, S, load_GM)
    for g in range(G):
        _peak(load_GM, g, peak_G)
    for e in range(E):
        while cnt_E[e] < target_E[e]:
            best_p = -1
            best_v = np.inf
            for g in range(G):
                # Every slot of a GPU has its worst window: a GPU that cannot win is not searched.
                if hold_EG[e, g] > 0 or (best_p >= 0 and not peak_G[g] < best_v - _TIE * best_v):
                    continue
                for p in range(g * S, (g + 1) * S):
                    x = phy_P[p]
                    if cnt_E[x] <= target_E[x] or cnt_E[x] <= 1:
                        continue
                    if capped:
                        d = _arrival(e, g, hold_EG, was_EG) - _departure(x, g, hold_EG, was_EG)
                        if moved + d > cap_total or in_G[g] + d > cap_G[g]:
                            continue
                    best_v = peak_G[g]
                    best_p = p
                    break
            if best_p < 0:
                break
            x = phy_P[best_p]
            g = best_p // S
            d = _arrival(e, g, hold_EG, was_EG) - _departure(x, g, hold_EG, was_EG)
            in_G[g] += d
            moved += d
            _shift(hold_EG, cnt_E, share_EM, load_GM, x, e, -1.0, peak_G)
            phy_P[best_p] = e
            cnt_E[x] -= 1
            cnt_E[e] += 1
            hold_EG[x, g] -= 1
            hold_EG[e, g] += 1
            _shift(hold_EG, cnt_E, share_EM, load_GM, x, e, 1.0, peak_G)
    return moved


@kernel(inline=True, error_model="numpy")
def _shift(hold_EG, cnt_E, share_EM, load_GM, x, e, sign, peak_G):
    """Add (sign 1) or take out (-1) the loads of every replica of experts x and e, and refresh
    the worst window of each GPU holding one (after adding: those GPUs include every GPU that
    held one before)."""
    G, M = load_GM.shape
    for g in range(G):
        hx = hold_EG[x, g]
        he = hold_EG[e, g]
        if hx == 0 and he == 0:
            continue
        for m in range(M):
            v = load_GM[g, m]
            for _ in range(hx):
                v += sign * (share_EM[x, m] / cnt_E[x])
            for _ in range(he):
                v += sign * (share_EM[e, m] / cnt_E[e])
            load_GM[g, m] = v
        if sign > 0:
            _peak(load_GM, g, peak_G)


@kernel(inline=True, error_model="numpy")
def _peak(load_GM, g, peak_G):
    """GPU g's worst window."""
    peak_G[g] = 0.0
    for m in range(load_GM.shape[1]):
        peak_G[g] = max(peak_G[g], load_GM[g, m])


@kernel(error_model="numpy")
def repair(ring_MLE, w_M, old_LP, blends_B, rounds_L, num_gpus, how, swap_fills, worst_weight, cap_total, cap_G,
           new_LP, cost_L2, first, stop):
    """Repair layers first..stop-1 of old_LP against the windows of ring_MLE, window m weighted
    w_M[m] in every mean and in the smooth maximum (see the module docstring). Layers are
    independent: blocks of them may run at once (each call has its own scratch).

    how: (beta, partners, sources, floor) of the swaps (`_swaps`).
    Per layer and blend: target replica counts (`_targets`), fill the experts below target
    (`_fill`), then rounds_L[l] swaps (`_swaps`); the blend whose result has the lightest worst
    window is kept when it beats the old placement's by more than 1e-12. Moves (experts landing
    on a GPU that did not hold them in old_LP) stay within cap_total per layer and cap_G[g] onto
    GPU g (inf: no cap). Writes new_LP [L, P] and cost_L2 [L, 2]: the cost (half the mean, half
    the worst window of the busiest GPU) of the old and the new placement.
    """
    M, L, E = ring_MLE.shape
    P = old_LP.shape[1]
    G = num_gpus
    S = P // G
    share_EM = np.empty((E, M))
    load_GM = np.empty((G, M))
    peak_G = np.empty(G)
    C = min(how[1], G) * S                           # candidate slots of one swap round
    # The swaps' scratch (see _swaps for the names), made once for all layers.
    work = (np.zeros(E, dtype=np.bool_), np.empty((E, M)), np.empty((E, M)), np.empty((E, M)), np.empty((G, M)),
            np.empty(G), np.empty(G), np.empty(G, dtype=np.int64), np.empty(C, dtype=np.int64),
            np.empty(C, dtype=np.int64), np.empty(C, dtype=np.int64), np.empty(C, dtype=np.bool_), np.empty(C),
            np.empty(C), np.empty((M, C)), np.empty((M, C)))
    cnt_E = np.empty(E, dtype=np.int64)
    B = blends_B.shape[0]
    # Each blend's targets, fill, its moves (total, per GPU), worst window, demand; scratch.
    blend = (np.empty((B, E), dtype=np.int64), np.empty((B, P), dtype=np.int64), np.zeros(B, dtype=np.int64),
             np.zeros((B, G), dtype=np.int64), np.empty(B), np.empty((B, E)), np.empty(E),
             np.empty(E, dtype=np.int64))
    # Small enough to stay in the L1 cache; all zero between uses (`_hold`, `_unhold`).
    hold_EG = np.zeros((E, G), dtype=np.int16)
    was_EG = np.zeros((E, G), dtype=np.bool_)
    in_G = np.empty(G, dtype=np.int64)
    phy_P = np.empty(P, dtype=np.int64)
    for l in range(first, stop):
        _shares(ring_MLE, l, G, share_EM)
        for p in range(P):
            was_EG[old_LP[l, p], p // S] = True
        cnt_E[:] = 0
        for p in range(P):
            cnt_E[old_LP[l, p]] += 1
        _loads(old_LP[l], cnt_E, share_EM, S, load_GM)
        old_cost, best_worst = _cost(load_GM, w_M, worst_weight)
        new_LP[l] = old_LP[l]
        cost_L2[l, 0] = old_cost
        cost_L2[l, 1] = old_cost
        # Step 1-2 for every blend; the swaps then start from the fills with the lightest worst
        # window (`swap_fills` of them), each blend whose targets differ from an earlier one's.
        _fill_blends(old_LP[l], blends_B, share_EM, w_M, S, G, worst_weight, cap_total, cap_G, cnt_E, hold_EG,
                     was_EG, in_G, load_GM, peak_G, blend)
        # Step 3, from the lightest fills; a result is kept when it beats the best worst window.
        worst_B = blend[4]
        for _ in range(min(swap_fills, blends_B.shape[0])):
            k = -1                          # the lightest fill left, the first of (near) equals
            for j in range(blends_B.shape[0]):
                if worst_B[j] < np.inf and (k < 0 or worst_B[j] < worst_B[k] - _TIE * worst_B[k]):
                    k = j
            if k < 0:
                break
            worst_B[k] = np.inf
            phy_P[:] = blend[1][k]
            cnt_E[:] = 0
            _hold(phy_P, S, hold_EG, cnt_E)
            in_G[:] = blend[3][k]
            if rounds_L[l] > 0:
                _swaps(phy_P, cnt_E, share_EM, w_M, S, rounds_L[l], how, (hold_EG, was_EG, in_G, cap_total, cap_G),
                       blend[2][k], load_GM, work)
            _unhold(phy_P, S, hold_EG)
            _loads(phy_P, cnt_E, share_EM, S, load_GM)
            cost, worst = _cost(load_GM, w_M, worst_weight)
            if worst < best_worst - 1e-12:
                best_worst = worst
                new_LP[l] = phy_P
                cost_L2[l, 1] = cost
        for p in range(P):
            was_EG[old_LP[l, p], p // S] = False


@kernel(inline=True, error_model="numpy")
def _fill_blends(old_P, blends_B, share_EM, w_M, S, G, worst_weight, cap_total, cap_G, cnt_E, hold_EG, was_EG, in_G,
                 load_GM, peak_G, blend):
    """Steps 1-2 of `repair` for one layer: each blend's target counts and fill (into `blend`),
    and the fill's worst window (inf for a blend whose targets an earlier one has: it is never
    swapped from, so not made; one window gives every blend the same demand)."""
    target_BE, fill_BP, moved_B, in_BG, worst_B, key_BE, per_E, heap_E = blend
    P = old_P.shape[0]
    for k in range(blends_B.shape[0]):
        _demand(share_EM, w_M, blends_B[k], key_BE[k])
        same = False
        for j in range(k):
            if (key_BE[j] == key_BE[k]).all():
                same = True
                target_BE[k] = target_BE[j]
                break
        if not same:
            _targets(key_BE[k], P, G, target_BE[k], per_E, heap_E)
            for j in range(k):
                if (target_BE[j] == target_BE[k]).all():
                    same = True
        if same:
            worst_B[k] = np.inf
            continue
        fill_BP[k] = old_P
        cnt_E[:] = 0
        _hold(fill_BP[k], S, hold_EG, cnt_E)
        in_G[:] = 0
        moved_B[k] = _fill(fill_BP[k], cnt_E, target_BE[k], share_EM, S, hold_EG, was_EG, in_G, 0, cap_total,
                           cap_G, load_GM, peak_G)
        _unhold(fill_BP[k], S, hold_EG)
        in_BG[k] = in_G
        _loads(fill_BP[k], cnt_E, share_EM, S, load_GM)      # afresh: the fill kept it incrementally
        worst_B[k] = _cost(load_GM, w_M, worst_weight)[1]


@kernel(inline=True, error_model="numpy")
def _hold(phy_P, S, hold_EG, cnt_E):
    """Count phy_P's replicas per expert (into cnt_E) and per expert and GPU (into hold_EG, all
    zero before)."""
    for p in range(phy_P.shape[0]):
        cnt_E[phy_P[p]] += 1
        hold_EG[phy_P[p], p // S] += 1


@kernel(inline=True, error_model="numpy")
def _unhold(phy_P, S, hold_EG):
    """Zero hold_EG again, given the map it counts (the fills and swaps keep it equal to their
    map's holdings): P writes, where clearing all E x G entries for every use would outweigh a
    layer's repair at 256 GPUs."""
    for p in range(phy_P.shape[0]):
        hold_EG[phy_P[p], p // S] = 0
