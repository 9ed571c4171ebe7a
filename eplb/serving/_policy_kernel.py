"""Compiled steps of the adaptive policy (numba): window scores and the repair of a placement.

Legend: M = windows in memory, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S slots, B = demand blends, C = partner GPUs a swap may reach.

- `window_busiest`: busiest / mean GPU of one placement on every window, [M, L] (even split);
- `repair`: per layer, the placement in force changed a little to balance every window
  (see `eplb.serving.repair.robust_repair` for the steps), and its cost before and after.
Windows arrive as they are kept (raw counts or planning loads, any order: every step here is
a sum or a maximum over windows) and are normalised per (window, layer) inside, so the mean
GPU load is 1 and a GPU's load reads as busiest / mean directly. Layers are independent: each
is repaired on its own, one after another. Every kernel trusts its input (eplb.serving.policy checks
it), releases the GIL (a serving thread keeps running while a side thread decides) and is
compiled with `cache=True`: only the first process after an install compiles
(`eplb.serving.repair.warm_up`). tests/oracles/policy.py is the plain numpy reference the tests compare
the repair with, slot by slot.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel

_TIE = 1e-12      # choices closer than this (relative) are ties, broken by order: equal swaps and GPUs
_EXP_CLIP = 600.0  # exp(600) is finite; only replicas above 12x the mean GPU load reach it at beta 50


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
def _loads(phy_P, cnt_E, share_EM, S, load_GM):
    """GPU loads of every window under an even split."""
    G, M = load_GM.shape
    load_GM[:] = 0.0
    for p in range(phy_P.shape[0]):
        e = phy_P[p]
        g = p // S
        for m in range(M):
            load_GM[g, m] += share_EM[e, m] / cnt_E[e]


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
def _arrival(e, g, hold_EG, was_EG):
    """Moves onto GPU g if expert e lands there (0 when g held it before the repair)."""
    return 0 if (hold_EG[e, g] > 0 or was_EG[e, g]) else 1


@kernel(inline=True, error_model="numpy")
def _departure(e, g, hold_EG, was_EG):
    """Moves onto GPU g undone if one replica of e leaves it (its only copy, moved there)."""
    return 1 if (hold_EG[e, g] == 1 and not was_EG[e, g]) else 0


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


@kernel(inline=True, error_model="numpy")
def _swaps(phy_P, cnt_E, share_EM, w_M, S, rounds, how, caps, moved, load_GM, work):
    """At most `rounds` swaps between a replica on one of the two GPUs with the heaviest worst
    window and a replica on one of the `partners` GPUs with the lightest, each the swap that
    lowers the smooth maximum Z = sum over (GPU, window) of exp(beta (load - top)) the most,
    while it drops (top: the heaviest load when the swaps start; Z's scale does not matter).

    A swap of slot a (GPU A, expert ea) with slot b (GPU B, eb) changes only A's and B's loads,
    and its gain in Z factors per window m, with x = exp(beta x an expert's load per replica):
    gain = sum_m eA + eB - (eA / x_ea) x_eb - x_ea (eB / x_eb). For one a the gains of all
    candidate b are accumulated window by window, each b's in the same order (vectorised over b).
    """
    beta, partners, sources, floor = how
    hold_EG, was_EG, in_G, cap_total, cap_G = caps
    ready_E, w_EM, x_EM, ix_EM, e_GM, peak_G, esum_G, order_G, cand_C, gpu_C, slot_C, free_C, base_C, gain_C, x_MC, \
        b_MC = work
    E, M = share_EM.shape
    G = load_GM.shape[0]
    capped = cap_total < np.inf or cap_G.min() < np.inf
    # Per-replica loads and their exponentials, made for an expert when a swap first looks at it.
    for e in range(E):
        ready_E[e] = False
    _loads(phy_P, cnt_E, share_EM, S, load_GM)
    top = 0.0
    for g in range(G):
        for m in range(M):
            top = max(top, load_GM[g, m])
    for g in range(G):
        _gpu_terms(g, load_GM, w_M, top, beta, e_GM, peak_G, esum_G)
    n_src = min(sources, G)
    for _ in range(rounds):
        z = 0.0
        for g in range(G):
            z += esum_G[g]
        # Heaviest worst window first, lower GPU on a tie: only both ends of the order are read.
        _rank_ends(peak_G, order_G, n_src, 0 if partners >= G else min(partners, G))
        nc = 0
        for j in range(min(partners, G)):
            # partners >= G: every GPU, in order; else the lightest (order_G from its end)
            B = j if partners >= G else order_G[G - 1 - j]
            for sb in range(S):
                b = B * S + sb
                eb = phy_P[b]
                if not ready_E[eb]:       # (tested here: see `_ready`)
                    _ready(eb, share_EM, cnt_E, beta, ready_E, w_EM, x_EM, ix_EM)
                cand_C[nc] = eb
                gpu_C[nc] = B
                slot_C[nc] = sb
                base_C[nc] = esum_G[B]
                for m in range(M):
                    x_MC[m, nc] = x_EM[eb, m]
                    b_MC[m, nc] = e_GM[B, m] * ix_EM[eb, m]
                nc += 1
        best = -np.inf
        best_a = -1
        best_b = -1
        for i in range(n_src):
            A = order_G[i]
            for k in range(nc):
                # Candidates that can never swap with a replica of A: on A, or their expert is on A.
                free_C[k] = gpu_C[k] != A and hold_EG[cand_C[k], A] == 0
            for sa in range(S):
                a = A * S + sa
                ea = phy_P[a]
                if not ready_E[ea]:
                    _ready(ea, share_EM, cnt_E, beta, ready_E, w_EM, x_EM, ix_EM)
                for k in range(nc):
                    gain_C[k] = esum_G[A] + base_C[k]
                for m in range(M):
                    am = e_GM[A, m] * ix_EM[ea, m]
                    xm = x_EM[ea, m]
                    for k in range(nc):
                        gain_C[k] -= am * x_MC[m, k] + xm * b_MC[m, k]
                for k in range(nc):
                    B = gpu_C[k]
                    eb = cand_C[k]
                    if not free_C[k] or eb == ea or hold_EG[ea, B] > 0:
                        continue
                    if capped:
                        dA = _arrival(eb, A, hold_EG, was_EG) - _departure(ea, A, hold_EG, was_EG)
                        dB = _arrival(ea, B, hold_EG, was_EG) - _departure(eb, B, hold_EG, was_EG)
                        if moved + dA + dB > cap_total or in_G[A] + dA > cap_G[A] or in_G[B] + dB > cap_G[B]:
                            continue
                    if best_a < 0 or gain_C[k] > best + _TIE * abs(best):
                        best = gain_C[k]
                        best_a = a
                        best_b = B * S + slot_C[k]
        if best_a < 0 or not best > floor * z:
            break
        a, b = best_a, best_b
        A, B = a // S, b // S
        ea, eb = phy_P[a], phy_P[b]
        dA = _arrival(eb, A, hold_EG, was_EG) - _departure(ea, A, hold_EG, was_EG)
        dB = _arrival(ea, B, hold_EG, was_EG) - _departure(eb, B, hold_EG, was_EG)
        in_G[A] += dA
        in_G[B] += dB
        moved += dA + dB
        phy_P[a] = eb
        phy_P[b] = ea
        hold_EG[ea, A] -= 1
        hold_EG[eb, A] += 1
        hold_EG[eb, B] -= 1
        hold_EG[ea, B] += 1
        for m in range(M):
            load_GM[A, m] += w_EM[eb, m] - w_EM[ea, m]
            load_GM[B, m] += w_EM[ea, m] - w_EM[eb, m]
        _gpu_terms(A, load_GM, w_M, top, beta, e_GM, peak_G, esum_G)
        _gpu_terms(B, load_GM, w_M, top, beta, e_GM, peak_G, esum_G)
    return moved


@kernel(inline=True, error_model="numpy")
def _ready(e, share_EM, cnt_E, beta, ready_E, w_EM, x_EM, ix_EM):
    """Expert e's load per replica w, x = exp(beta w) and 1 / x, per window (once per swap phase:
    callers test ready_E[e] first, as numba reference-counts an inlined helper's array
    arguments at every call, which cost more than the test)."""
    for m in range(share_EM.shape[1]):
        w_EM[e, m] = share_EM[e, m] / cnt_E[e]
        x_EM[e, m] = np.exp(min(beta * w_EM[e, m], _EXP_CLIP))
        ix_EM[e, m] = 1.0 / x_EM[e, m]
    ready_E[e] = True


@kernel(inline=True, error_model="numpy")
def _rank(peak_G, order_G):
    """GPUs by worst window, heaviest first; among equals the lower GPU first (insertion sort:
    G is small and nothing is allocated)."""
    G = peak_G.shape[0]
    for g in range(G):
        order_G[g] = g
    for i in range(1, G):
        g = order_G[i]
        j = i - 1
        while j >= 0 and peak_G[order_G[j]] < peak_G[g]:
            order_G[j + 1] = order_G[j]
            j -= 1
        order_G[j + 1] = g


@kernel(inline=True, error_model="numpy")
def _before(peak_G, a, b):
    """Does GPU a come before GPU b in `_rank`'s order (heavier, or as heavy and lower)?"""
    return peak_G[a] > peak_G[b] or (peak_G[a] == peak_G[b] and a < b)


@kernel(inline=True, error_model="numpy")
def _rank_ends(peak_G, order_G, n_top, n_bottom):
    """The first n_top and the last n_bottom entries of `_rank`'s order, the rest left as they
    were, in one pass over the GPUs (a swap round reads only the two heaviest and the `partners`
    lightest; a full sort of 256 GPUs in every round would outweigh the swaps themselves). A GPU joins
    an end only if it beats that end's innermost entry, and is then put in its place there."""
    G = peak_G.shape[0]
    if n_top + n_bottom > G:
        _rank(peak_G, order_G)
        return
    for g in range(G):
        # Top: order_G[0] first; a GPU enters if it comes before order_G[n_top - 1].
        n = min(g, n_top)
        if n_top > 0 and (n < n_top or _before(peak_G, g, order_G[n - 1])):
            j = n if n < n_top else n - 1
            while j > 0 and _before(peak_G, g, order_G[j - 1]):
                order_G[j] = order_G[j - 1]
                j -= 1
            order_G[j] = g
        # Bottom: order_G[G - 1] last; a GPU enters if it comes after order_G[G - n_bottom].
        n = min(g, n_bottom)
        if n_bottom > 0 and (n < n_bottom or _before(peak_G, order_G[G - n], g)):
            j = n if n < n_bottom else n - 1
            while j > 0 and _before(peak_G, order_G[G - j], g):
                order_G[G - 1 - j] = order_G[G - j]
                j -= 1
            order_G[G - 1 - j] = g


@kernel(inline=True, error_model="numpy")
def _gpu_terms(g, load_GM, w_M, top, beta, e_GM, peak_G, esum_G):
    """GPU g's worst window, its terms of Z (each window's weighted by w_M) and their sum."""
    M = load_GM.shape[1]
    peak_G[g] = 0.0
    esum_G[g] = 0.0
    for m in range(M):
        peak_G[g] = max(peak_G[g], load_GM[g, m])
        e_GM[g, m] = w_M[m] * np.exp(beta * (load_GM[g, m] - top))
        esum_G[g] += e_GM[g, m]


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
    target_BE = np.empty((B, E), dtype=np.int64)
    fill_BP = np.empty((B, P), dtype=np.int64)
    moved_B = np.zeros(B, dtype=np.int64)
    in_BG = np.zeros((B, G), dtype=np.int64)
    worst_B = np.empty(B)
    key_BE = np.empty((B, E))
    per_E = np.empty(E)
    heap_E = np.empty(E, dtype=np.int64)
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
        nb = blends_B.shape[0]
        for k in range(nb):
            # A blend with the targets of an earlier one has its fill too: never swapped from,
            # so not made. One window gives every blend the same demand, and its targets are
            # not counted again either.
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
            fill_BP[k] = old_LP[l]
            cnt_E[:] = 0
            _hold(fill_BP[k], S, hold_EG, cnt_E)
            in_G[:] = 0
            moved_B[k] = _fill(fill_BP[k], cnt_E, target_BE[k], share_EM, S, hold_EG, was_EG, in_G, 0, cap_total,
                               cap_G, load_GM, peak_G)
            _unhold(fill_BP[k], S, hold_EG)
            in_BG[k] = in_G
            _loads(fill_BP[k], cnt_E, share_EM, S, load_GM)      # afresh: the fill kept it incrementally
            cost, worst_B[k] = _cost(load_GM, w_M, worst_weight)
        for _ in range(min(swap_fills, nb)):
            k = -1                          # the lightest fill left, the first of (near) equals
            for j in range(nb):
                if worst_B[j] < np.inf and (k < 0 or worst_B[j] < worst_B[k] - _TIE * worst_B[k]):
                    k = j
            if k < 0:
                break
            worst_B[k] = np.inf
            phy_P[:] = fill_BP[k]
            cnt_E[:] = 0
            _hold(phy_P, S, hold_EG, cnt_E)
            in_G[:] = in_BG[k]
            if rounds_L[l] > 0:
                _swaps(phy_P, cnt_E, share_EM, w_M, S, rounds_L[l], how, (hold_EG, was_EG, in_G, cap_total, cap_G),
                       moved_B[k], load_GM, work)
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
