"""The adaptive policy's replica swaps (`_policy_kernel.repair`'s step 3) and the per-GPU
bookkeeping the fill shares with them.

Legend: M = windows in memory, E = logical experts, G = GPUs, S = slots per GPU, P = G x S
slots, C = the candidate slots of one swap round (partner GPUs x S).

`_swaps` makes the swaps that lower the smooth maximum of every (GPU, window) load most, one at
a time: `_partners` lists the candidates on the lightest GPUs, `_best_pair` prices every pair
with a replica of the heaviest GPUs, `_swap_pair` makes the best. Loads are per (window, GPU)
after normalisation (mean GPU load 1; see `_policy_kernel`).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel

_TIE = 1e-12      # choices closer than this (relative) are ties, broken by order: equal swaps and GPUs


_EXP_CLIP = 600.0  # exp(600) is finite; only replicas above 12x the mean GPU load reach it at beta 50


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
def _arrival(e, g, hold_EG, was_EG):
    """Moves onto GPU g if expert e lands there (0 when g held it before the repair)."""
    return 0 if (hold_EG[e, g] > 0 or was_EG[e, g]) else 1


@kernel(inline=True, error_model="numpy")
def _departure(e, g, hold_EG, was_EG):
    """Moves onto GPU g undone if one replica of e leaves it (its only copy, moved there)."""
    return 1 if (hold_EG[e, g] == 1 and not was_EG[e, g]) else 0


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
    ready_E, w_EM, x_EM, ix_EM, e_GM, peak_G, esum_G, order_G = work[:8]
    E, M = share_EM.shape
    G = load_GM.shape[0]
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
        nc = _partners(phy_P, cnt_E, share_EM, S, beta, partners, work)
        best, a, b = _best_pair(phy_P, cnt_E, share_EM, S, beta, n_src, nc, caps, moved, work)
        if a < 0 or not best > floor * z:
            break
        moved = _swap_pair(phy_P, a, b, S, w_M, top, beta, caps, moved, load_GM, work)
    return moved


@kernel(inline=True, error_model="numpy")
def _partners(phy_P, cnt_E, share_EM, S, beta, partners, work):
    """The candidate partners' replicas (`partners` lightest GPUs, or every GPU), with their terms
    of the gain; returns how many."""
    ready_E, w_EM, x_EM, ix_EM, e_GM, peak_G, esum_G, order_G, cand_C, gpu_C, slot_C, free_C, base_C, gain_C, x_MC, \
        b_MC = work
    M = share_EM.shape[1]
    G = e_GM.shape[0]
    nc = 0
    for j in range(min(partners, G)):
        # partners >= G: every GPU, in order; else the lightest (order_G from its end)
        B = j if partners >= G else order_G[G - 1 - j]
        for sb in range(S):
            eb = phy_P[B * S + sb]
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
    return nc


@kernel(inline=True, error_model="numpy")
def _best_pair(phy_P, cnt_E, share_EM, S, beta, n_src, nc, caps, moved, work):
    """(gain, slot a, slot b) of the best swap from the n_src heaviest GPUs with the nc candidates,
    within the move caps; a = -1 when none is allowed."""
    ready_E, w_EM, x_EM, ix_EM, e_GM, peak_G, esum_G, order_G, cand_C, gpu_C, slot_C, free_C, base_C, gain_C, x_MC, \
        b_MC = work
    hold_EG, was_EG, in_G, cap_total, cap_G = caps
    capped = cap_total < np.inf or cap_G.min() < np.inf
    M = share_EM.shape[1]
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
    return best, best_a, best_b


@kernel(inline=True, error_model="numpy")
def _swap_pair(phy_P, a, b, S, w_M, top, beta, caps, moved, load_GM, work):
    """Swap the replicas of slots a and b: holdings, move counts, window loads and the two GPUs'
    terms of Z; returns the moves made so far."""
    w_EM, e_GM, peak_G, esum_G = work[1], work[4], work[5], work[6]
    hold_EG, was_EG, in_G = caps[0], caps[1], caps[2]
    M = load_GM.shape[1]
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
